"""The ONNX Runtime backend (no torch): sessions (:mod:`.sessions`), prefill through IOBinding
with the states left in ``OrtValue``s on the device, and the decoders of :mod:`.decoders`
(:class:`~.decoders.BoundDecoder`: A/B buffers bound once, KV in place with ``--ops ort``;
:class:`~.decoders.HostDecoder`: ``--host-state-roundtrip``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...contract import STATE_NAMES, ContractError, ShapeContract
from ...host_memory import reserve_zeros
from ..backend import Backend, Decoder, Precision, Runtime, RuntimeOptions, fill_state
from ..draft_buffers import MtpCache, VerifyBuffers
from .decoders import NP_DTYPES, BoundDecoder, HostDecoder, bind_state_output, run_chunk_bound, run_host
from .sessions import OrtGraphSet, providers_for, run_options
from .speculative import run_mtp, run_verify_bound, run_verify_host


class OrtBackend(Backend):
    """ONNX Runtime with ``options`` (device 'cpu' or 'cuda', threads, host-state roundtrip; default
    :class:`~qwen35_onnx.runtime.backend.RuntimeOptions`). ``loading`` is how the graphs share their
    weights, passed to :class:`~.sessions.OrtGraphSet`: ``share_weights`` (False: every session its
    own, as ONNX Runtime does by default, for comparison), ``prepacked_cache`` (True: the pre-packed
    weights cache of :mod:`.prepacked` in its default folder; a folder; False: each session packs
    its own weights) and ``max_prefill_sessions``.

    Raises:
        ValueError: unknown device, or an onnxruntime without its provider.
        ContractError: see :class:`~.sessions.OrtGraphSet`.
    """

    runtime = Runtime.ONNXRUNTIME
    precision = Precision.F32  # no precision hint: the graphs compute in their exported dtype

    def __init__(self, root: Path, contract: ShapeContract, options: RuntimeOptions | None = None, **loading):
        options = options or RuntimeOptions()
        providers_for(options.device)  # a bad device fails before any graph loads
        self.contract, self.device, self.host_state_roundtrip = contract, options.device, options.host_state_roundtrip
        self.graphs = OrtGraphSet(root, contract, options, **loading)
        if contract.dtype not in NP_DTYPES:  # a provider loaded the graphs, but numpy cannot hold the states
            raise ContractError(
                f"the export at {str(root)!r} is {contract.dtype}: this runtime's ONNX Runtime path keeps decode "
                f"states in buffers of {', '.join(NP_DTYPES)} only; run it with --runtime openvino"
            )

    def shared_weight_bytes(self) -> dict[str, int]:
        """``{'mapped': ..., 'transposed': ...}``: fp32 text weights mapped once and the narrow ones
        held transposed (:mod:`.shared_weights`); or ``{'prepacked': ...}``: the pre-packed weights
        cache's bytes on disk, which every session maps (:mod:`.prepacked`); empty where each
        session holds its own weights."""
        graphs = self.graphs
        if graphs.prepacked is not None:
            return {"prepacked": graphs.prepacked.disk_bytes()}
        if graphs.weights is not None:
            return {"mapped": graphs.weights.mapped_bytes(), "transposed": graphs.weights.transposed_bytes()}
        return {}

    def _run_vision(self, graph, feeds: dict[str, np.ndarray]) -> np.ndarray:
        tokens = len(feeds["pixel_values"]) // self.contract.spatial_merge_size**2  # image tokens
        (embeds,) = graph.session.run(None, feeds, run_options(tokens))
        return embeds

    def run_prefill(self, bucket: int | None, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        session = self.graphs.prefill(bucket).session
        graph_outputs = session.get_outputs()
        names = [o.name for o in graph_outputs]
        options = run_options(feeds["input_ids"].shape[-1])
        if self.host_state_roundtrip:
            outputs = dict(zip(names, session.run(None, feeds, options)))
            return outputs.pop("logits"), outputs
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for output in graph_outputs:  # fresh OrtValues on the device each run
            if output.name == "logits":
                binding.bind_output(output.name, self.device)
            else:
                bind_state_output(binding, output, self.device)  # the generation keeps them
        session.run_with_iobinding(binding, options)
        outputs = dict(zip(names, binding.get_outputs()))
        return outputs.pop("logits").numpy(), outputs

    def run_chunk(self, size: int, feeds: dict[str, np.ndarray], states: dict) -> tuple[np.ndarray, dict]:
        session = self.graphs.chunk(size).session
        options = run_options(size)
        if self.host_state_roundtrip:
            return run_host(session, self.contract, feeds, states, options)
        return run_chunk_bound(session, self.contract, self.device, feeds, states, options)

    def run_verify(self, size: int, feeds: dict[str, np.ndarray], states: dict, buffers: VerifyBuffers):
        self.check_speculation()
        session = self.graphs.verify(size).session
        run = run_verify_host if self.host_state_roundtrip else run_verify_bound
        return run(session, self.contract, feeds, states, buffers, run_options(size))

    def run_mtp(self, size: int, feeds: dict[str, np.ndarray], kv: MtpCache):
        session = self.graphs.mtp(size).session
        return run_mtp(session, self.contract, feeds, kv, run_options(size))

    def states_to_host(self, states: dict, kv_length: int | None = None) -> dict[str, np.ndarray]:
        arrays = {}
        for name, value in states.items():
            array = value.numpy() if isinstance(value, ort.OrtValue) else value
            if kv_length is not None and name == "present_kv_cache":
                array = array[:, :, :, :kv_length]
            arrays[name] = np.array(array, copy=True)
        return arrays

    def states_from_host(
        self, arrays: dict[str, np.ndarray], kv_dtype: str | None = None, width: int | None = None
    ) -> dict:
        # the buffers take the arrays' dtypes (kv_dtype names the KV cache's, which its array has)
        states = {}
        for name, value in arrays.items():
            shape = self.contract.state_shape(name.removeprefix("present_"), width)
            if self.host_state_roundtrip:
                states[name] = np.empty(shape, dtype=value.dtype)
                fill_state(states[name], value)
                continue
            if self.device == "cpu":  # committed as written: the capacity costs the slots in use (host_memory)
                array = reserve_zeros(shape, value.dtype)
                fill_state(array, value, zeroed=True)
                states[name] = ort.OrtValue.ortvalue_from_numpy(array)
                continue
            buffer = ort.OrtValue.ortvalue_from_shape_and_type(shape, value.dtype, self.device, 0)
            full = np.empty(shape, dtype=value.dtype)
            fill_state(full, value)
            buffer.update_inplace(full)
            states[name] = buffer
        return states

    def decoder(self, states: dict) -> Decoder:
        if self.host_state_roundtrip:
            return HostDecoder(self.graphs.decode, self.contract, states)
        return BoundDecoder(self.graphs.decode, self.contract, states, self.device)

    @staticmethod
    def state_shape(value) -> list[int]:
        return list(value.shape()) if isinstance(value, ort.OrtValue) else list(value.shape)

    def _check_host_addressable(self) -> None:
        if self.device != "cpu" and not self.host_state_roundtrip:
            raise ContractError(
                f"decode slots run on the CPU: this runtime copies a request's states into its slot as host arrays, "
                f"which device {self.device!r} does not offer (the export has {self.contract.slots} slots; run it with "
                "--device cpu, or re-export with --slots 1)"
            )

    def _zero_slot_states(self, width: int | None = None) -> dict:
        self._check_host_addressable()
        c, states = self.contract, {}
        for state in STATE_NAMES:
            shape, dtype = c.slot_state_shape(state, width), NP_DTYPES[c.state_dtype(state)]
            if self.host_state_roundtrip:
                states[f"present_{state}"] = np.zeros(shape, dtype=dtype)
                continue
            # committed as written (host_memory.reserve_zeros): S slots of the whole capacity cost the tokens in use
            states[f"present_{state}"] = ort.OrtValue.ortvalue_from_numpy(reserve_zeros(shape, dtype))
        return states

    def state_views(self, states: dict) -> dict[str, np.ndarray]:
        self._check_host_addressable()
        return {name: value.numpy() if isinstance(value, ort.OrtValue) else value for name, value in states.items()}
