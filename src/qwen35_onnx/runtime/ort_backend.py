"""The ONNX Runtime backend (no torch): sessions (:mod:`.sessions`), prefill through IOBinding
with the states left in ``OrtValue``s on the device, and the decoders of :mod:`.state`
(:class:`~.state.BoundDecoder`: A/B buffers bound once, KV in place with ``--ops ort``;
:class:`~.state.HostDecoder`: ``--host-state-roundtrip``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..contract import ContractError, ShapeContract
from .backend import Backend, Decoder
from .sessions import GraphSet, providers_for
from .state import NP_DTYPES, BoundDecoder, HostDecoder


class OrtBackend(Backend):
    """ONNX Runtime on ``device`` ('cpu' or 'cuda'). On CPU the text graphs share one copy of the
    text weights (see :mod:`.shared_weights`); ``share_weights=False`` gives every session its
    own, as ONNX Runtime does by default (for comparison). Quantized, fp16 and bf16 exports load
    through the pre-packed weights cache (:mod:`.prepacked`; ``prepacked_cache``: True for its
    default folder, a folder, or False: each session packs its own weights). ``max_prefill_sessions``:
    see :class:`~.sessions.GraphSet` (prefill sessions that pack their own weights are bounded).

    Raises:
        ValueError: unknown device, or an onnxruntime without its provider.
        ContractError: see :class:`~.sessions.GraphSet`.
    """

    runtime = "onnxruntime"
    precision = "f32"  # no precision hint: the graphs compute in their exported dtype

    def __init__(self, root: Path, contract: ShapeContract, device: str = "cpu", threads: int = 0,
                 host_state_roundtrip: bool = False, share_weights: bool = True,
                 max_prefill_sessions: int | None = None, prepacked_cache: bool | Path = True):
        providers_for(device)  # a bad device fails before any graph loads
        self.contract, self.device, self.host_state_roundtrip = contract, device, host_state_roundtrip
        self.graphs = GraphSet(root, contract, device=device, threads=threads, share_weights=share_weights,
                               max_prefill_sessions=max_prefill_sessions, prepacked_cache=prepacked_cache)
        if contract.dtype not in NP_DTYPES:  # a provider loaded the graphs, but numpy cannot hold the states
            raise ContractError(
                f"the export at {str(root)!r} is {contract.dtype}: this runtime's ONNX Runtime path keeps decode states "
                f"in buffers of {', '.join(NP_DTYPES)} only; run it with --runtime openvino"
            )

    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        (embeds,) = self.graphs.vision.session.run(None, {"pixel_values": pixel_values})
        return embeds

    def run_prefill(self, bucket: int | None, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        session = self.graphs.prefill(bucket).session
        names = [o.name for o in session.get_outputs()]
        if self.host_state_roundtrip:
            outputs = dict(zip(names, session.run(None, feeds)))
            return outputs.pop("logits"), outputs
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in names:
            binding.bind_output(name, self.device)  # fresh OrtValues on the device each run
        session.run_with_iobinding(binding)
        outputs = dict(zip(names, binding.get_outputs()))
        return outputs.pop("logits").numpy(), outputs

    def decoder(self, states: dict) -> Decoder:
        if self.host_state_roundtrip:
            return HostDecoder(self.graphs.decode, self.contract, states)
        return BoundDecoder(self.graphs.decode, self.contract, states, self.device)

    @staticmethod
    def state_shape(value) -> list[int]:
        return list(value.shape()) if isinstance(value, ort.OrtValue) else list(value.shape)
