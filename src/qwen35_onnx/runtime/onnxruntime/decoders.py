"""Decode-step execution with device-resident state (no torch).

:class:`BoundDecoder` keeps the conv, recurrent and KV states in ONNX Runtime ``OrtValue``s
between steps and binds them with IOBinding. Output buffers (logits, conv, recurrent, and
KV in fixed mode) are preallocated twice and alternate A/B by step parity, so a step never
writes the buffer it reads. With ``--ops ort`` and fixed KV the decode graph takes every state
one entry at a time and the entries are bound by address inside those stacked buffers (no
split or concatenation per step); the KV cache is then updated in place (one slot per layer
per step), and on the CPU so is the recurrent state (ONNX Runtime's LinearAttention copies its
past state into its present output before updating it there: bound to one buffer, the copy of
16 x 128 x 128 floats per layer and step goes; 1.1 ms of a 17 ms 0.8B step, paired median of 12
alternations). On the CPU a step returns the logits array it wrote, without a copy, and never
writes into an array a caller still references (:meth:`BoundDecoder._claim_logits`). In dynamic
mode the KV output grows by one token per step, so ONNX Runtime allocates it each step.
:class:`HostDecoder` is the copy-to-host fallback (``--host-state-roundtrip``) kept for comparison.

Both expose ``step(input_ids, attention_mask, position_ids) -> logits [1, 1, V] fp32``.
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort

from ...contract import STATE_NAMES, KvMode, ShapeContract
from ...host_memory import reserve_zeros
from ..backend import host_inputs
from ..checks import ONNX_TYPES
from .sessions import GraphSession

NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
"""numpy dtypes of the contract dtypes ONNX Runtime's Python API can allocate (numpy has no bf16)."""


class BoundDecoder:
    """IOBinding decode loop state. ``device`` is 'cpu' or 'cuda' (ORT device names).

    Fixed KV: both parities' bindings are built once; a step copies the three small inputs
    into host buffers that stay bound and runs one binding, so no binding call happens per
    token. With :attr:`ShapeContract.kv_in_place` (``--ops ort``) every state is passed one entry
    at a time and each entry is bound by address inside a stacked buffer: ``past_conv_states.{n}``
    inside the A/B set read at this step, ``present_conv_states.{n}`` inside the set written (the
    same for the recurrent states), and the KV cache stays in the prefill's stacked
    ``present_kv_cache`` buffer: entry ``j`` is bound as both ``past_kv_cache.{j}`` and
    ``present_kv_cache.{j}``, so GroupQueryAttention writes one slot per layer and nothing else.
    On the CPU the recurrent states stay in the prefill's ``present_recurrent_states`` buffer the
    same way (:attr:`updated_in_place`): a step overwrites the states it started from, so the
    states a generation started with are not kept (take a host copy first: ``states_to_host``).
    Dynamic KV rebinds every step (the cache grows).

    Args:
        decode: the decode graph session.
        contract: the export contract (capacity, state shapes, kv mode).
        states: the prefill outputs ``present_conv_states``, ``present_recurrent_states``,
            ``present_kv_cache`` as OrtValues (already on the device); they become the first
            step's past (and, in fixed mode, one of the two A/B buffer sets).
    """

    def __init__(
        self, decode: GraphSession, contract: ShapeContract, states: dict[str, ort.OrtValue], device: str = "cpu"
    ):
        self.session = decode.session
        self.contract = contract
        self.device = device
        self.fixed = contract.kv_mode == KvMode.FIXED
        self.in_place = contract.kv_in_place
        # The states each step updates inside the prefill's buffers (not double-buffered): with
        # kv_in_place the KV cache, and on the CPU the recurrent states too (see the class docstring)
        kept = ("kv_cache", "recurrent_states") if device == "cpu" else ("kv_cache",)
        self.updated_in_place = {f"present_{n}": states[f"present_{n}"] for n in kept} if self.in_place else {}
        """``present_*`` name -> the prefill's stacked buffer that every step reads and writes."""
        # dynamic mode: the KV output is allocated by ONNX Runtime each step
        buffered = [n for n in STATE_NAMES if f"present_{n}" not in self.updated_in_place]
        if not self.fixed:
            buffered.remove("kv_cache")
        # fixed KV: the width of the states given (the capacity, or a KV tier of the export)
        kv = states["present_kv_cache"]
        self.width = int((kv.shape() if isinstance(kv, ort.OrtValue) else kv.shape)[3]) if self.fixed else None
        shapes = {
            f"present_{name}": (contract.slot_state_shape(name, self.width), NP_DTYPES[contract.state_dtype(name)])
            for name in buffered
        }
        # Two complete sets of output buffers: set p is written at steps of parity p; the
        # prefill's states serve as set 1 (read by step 0). On the CPU reserved as the KV cache is
        # (host_memory.reserve_zeros: freed back to the system with the decoder).
        new = ort.OrtValue.ortvalue_from_shape_and_type
        if device == "cpu":
            fresh = {
                name: ort.OrtValue.ortvalue_from_numpy(reserve_zeros(shape, dt)) for name, (shape, dt) in shapes.items()
            }
        else:
            fresh = {name: new(shape, dt, device, 0) for name, (shape, dt) in shapes.items()}
        self.buffers = [fresh, {name: states[name] for name in shapes}]
        # On the CPU the logits are written into numpy arrays that step() returns as they are: no
        # copy of V floats (1 MB at 0.8B, read back from the last-level cache; with the cheaper
        # finiteness check the host's time per 0.8B step went from 0.60 to 0.40 ms); a step only
        # writes into an array nobody else holds (see _claim_logits)
        self.logits_shape = (contract.slots, 1, contract.vocab_size)
        self.logits: list[np.ndarray] | None = None
        if device == "cpu":
            self.logits = [self._new_logits(p) for p in (0, 1)]
            self.free_refs = sys.getrefcount(self.logits[0])
            """References to an entry of :attr:`logits` that this decoder holds itself."""
        else:
            for buffers in self.buffers:
                buffers["logits"] = new(self.logits_shape, np.float32, device, 0)
        self.kv = states["present_kv_cache"]
        self.steps = 0
        self.hosts: dict[int, dict[str, np.ndarray]] = {}
        """Rows -> the host input buffers of a step of that many rows (bound once, rewritten per step)."""
        self.bindings: dict[tuple[int, int], ort.IOBinding] = {}
        """(parity, rows) -> the binding of a step (fixed KV; built on first use, kept)."""
        self.prefixes: dict[tuple[int, int], np.ndarray] = {}
        """(parity, rows) -> the view of the first ``rows`` of ``logits[parity]`` bound as that step's output
        (fewer rows than the slots): each references the array once, which :meth:`_claim_logits` counts as
        this decoder's own (else every step of fewer rows made a new array and bound its step again)."""
        if self.fixed:
            for parity in (0, 1):
                self._binding(parity, contract.slots)

    def _binding(self, parity: int, rows: int) -> ort.IOBinding:
        key = (parity, rows)
        if key not in self.bindings:
            self.bindings[key] = self._bind(parity, rows)
        return self.bindings[key]

    def _host(self, rows: int) -> dict[str, np.ndarray]:
        if rows not in self.hosts:
            self.hosts[rows] = host_inputs(self.contract, rows, self.width)
        return self.hosts[rows]

    def _bind(self, parity: int, rows: int, attention_mask: np.ndarray | None = None) -> ort.IOBinding:
        """The binding of a step of ``parity`` over the first ``rows`` slots (a graph with a dynamic row axis
        takes fewer than the export's slots: the entries' first rows, by address)."""
        binding = self.session.io_binding()
        for name, array in self._host(rows).items():
            if name == "attention_mask" and attention_mask is not None:
                array = attention_mask
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        past, out = self.buffers[1 - parity], self.buffers[parity]
        if self.in_place:
            if rows == self.contract.slots:
                binding.bind_ortvalue_output("logits", out["logits"])
            else:  # the first rows of the host logits (a contiguous prefix), a view kept with the binding
                view = self.prefixes[(parity, rows)] = self.logits[parity][:rows]
                binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(view))
            for name in STATE_NAMES:
                key = f"present_{name}"
                kept = self.updated_in_place.get(key)  # past and present: the same entry
                self._bind_entries(binding, name, "past", past[key] if kept is None else kept, rows)
                self._bind_entries(binding, name, "present", out[key] if kept is None else kept, rows)
            return binding
        for name in ("conv_states", "recurrent_states"):
            binding.bind_ortvalue_input(f"past_{name}", past[f"present_{name}"])
        for name, value in out.items():
            binding.bind_ortvalue_output(name, value)
        if self.fixed:
            binding.bind_ortvalue_input("past_kv_cache", past["present_kv_cache"])
        else:
            binding.bind_ortvalue_input("past_kv_cache", self.kv)
            binding.bind_output("present_kv_cache", self.device)
        return binding

    def _new_logits(self, parity: int) -> np.ndarray:
        """A new host logits array for steps of ``parity``, shared with the OrtValue bound as their
        ``logits`` output (``OrtValue.ortvalue_from_numpy`` of a CPU array does not copy)."""
        array = np.empty(self.logits_shape, dtype=np.float32)
        self.buffers[parity]["logits"] = ort.OrtValue.ortvalue_from_numpy(array)
        return array

    def _claim_logits(self, parity: int) -> None:
        """Before a step of ``parity``: the array it will write must be one no caller holds. The
        array returned two steps before is reused when every reference to it (and to any view of
        it: a view references its base) is gone, which is the case for a loop that samples and
        drops the logits; otherwise the step gets a new array, rebound as its output."""
        array = self.logits[parity]  # each of this decoder's views of it references it once
        prefixes = sum(key[0] == parity and view.base is array for key, view in self.prefixes.items())
        if sys.getrefcount(array) - 1 <= self.free_refs + prefixes:  # (less the local name's reference)
            return
        del array
        self.logits[parity] = self._new_logits(parity)
        for key in [key for key in self.bindings if key[0] == parity]:
            if key[1] == self.contract.slots:
                self.bindings[key].bind_ortvalue_output("logits", self.buffers[parity]["logits"])
            else:  # bound to a prefix of the old array: bound again on next use
                del self.bindings[key]
        for key in [key for key in self.prefixes if key[0] == parity]:
            del self.prefixes[key]

    def _bind_entries(self, binding: ort.IOBinding, state: str, prefix: str, stacked: ort.OrtValue, rows: int) -> None:
        bind_entries(binding, self.contract, self.device, state, prefix, stacked, self.contract.slots, rows)

    def states(self) -> dict[str, ort.OrtValue]:
        """The states after the last step (the prefill's before the first), this decoder's buffers."""
        latest = self.buffers[(self.steps - 1) % 2 if self.steps else 1]
        states = {name: value for name, value in latest.items() if name != "logits"}
        states.update(self.updated_in_place)
        states.setdefault("present_kv_cache", self.kv)  # dynamic mode: ONNX Runtime's latest output
        return states

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        active_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one decode step over ``R = len(input_ids)`` rows (the export's slots, or with
        :attr:`ShapeContract.dynamic_rows` the first ``R`` of them); returns logits ``[R, 1, V]`` fp32: a
        host array that no later step writes while it (or a view of it) is referenced (on the CPU the
        array the step wrote, else a copy).

        Raises:
            ValueError: another row count than the export's slots where the graph's rows are static.
        """
        rows = int(input_ids.shape[0])
        if rows != self.contract.slots and not self.contract.dynamic_rows:
            raise ValueError(f"this decode graph steps {self.contract.slots} rows at once, got {rows}")
        parity = self.steps % 2
        if self.logits is not None:
            self._claim_logits(parity)
        host = self._host(rows)
        np.copyto(host["input_ids"], input_ids)
        np.copyto(host["position_ids"], position_ids)
        if "active_rows" in host:
            np.copyto(host["active_rows"], active_rows)
        if self.fixed:
            np.copyto(host["attention_mask"], attention_mask)
            binding = self._binding(parity, rows)
        else:
            binding = self._bind(parity, rows, np.ascontiguousarray(attention_mask, dtype=np.int64))
        self.session.run_with_iobinding(binding)
        if not self.fixed:
            self.kv = binding.get_outputs()[-1]  # outputs come back in binding order
        self.steps += 1
        if self.logits is not None:
            return self.logits[parity] if rows == self.contract.slots else self.logits[parity][:rows]
        return self.buffers[parity]["logits"].numpy()  # a device tensor: copied to the host


ORT_TYPES = {ONNX_TYPES[dtype]: np_dtype for dtype, np_dtype in NP_DTYPES.items()}
"""numpy dtypes of the ONNX Runtime output types :func:`bind_state_output` allocates itself."""


def bind_state_output(binding: ort.IOBinding, output, device: str, shape: list[int] | None = None) -> None:
    """Bind the graph output ``output`` (a ``NodeArg`` of ``session.get_outputs()``) to a new
    buffer of its own (``OrtValue.ortvalue_from_shape_and_type``: ONNX Runtime's default allocator
    on ``device``), not one from the session's arena: a state a generation keeps (``[L, ...]``
    conv, recurrent, KV) then pins none of the CPU arena that vision, prefill and chunk runs share
    (:class:`.sessions.Activations`), and freeing it hands its memory back. ``shape``: the output's
    shape where the graph's is symbolic (a KV tier's width). Outputs with a symbolic dimension
    otherwise (dynamic KV) or another element type are left to the session (``bind_output``)."""
    shape = output.shape if shape is None else shape
    if output.type not in ORT_TYPES or not all(isinstance(d, int) for d in shape):
        binding.bind_output(output.name, device)
        return
    buffer = ort.OrtValue.ortvalue_from_shape_and_type(shape, ORT_TYPES[output.type], device, 0)
    binding.bind_ortvalue_output(output.name, buffer)


def bind_entries(
    binding: ort.IOBinding,
    contract: ShapeContract,
    device: str,
    state: str,
    prefix: str,
    stacked: ort.OrtValue,
    rows: int = 1,
    bound_rows: int | None = None,
) -> None:
    """Bind ``{prefix}_{state}.{j}`` (inputs for ``prefix='past'``, outputs for ``'present'``) to
    entry ``j`` of ``stacked`` (a contiguous ``state_shape(state)`` buffer on ``device`` with ``rows``
    on its batch axis: 1 for a chunk graph, the export's slots for decode) by address; with
    ``bound_rows`` only the entry's first rows (a decode step over the first slots).

    Raises:
        ValueError: ``stacked`` has another shape than the contract's.
    """
    shape = list(contract.state_shape(state))
    shape[1] = rows
    dtype = ORT_TYPES[stacked.data_type()]  # (the KV cache's: the prompt graphs' dtype or the decode graph's)
    if list(stacked.shape()) != list(shape):
        raise ValueError(f"{state} buffer has shape {stacked.shape()}, expected {list(shape)}")
    nbytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    base = stacked.data_ptr()
    bind = binding.bind_input if prefix == "past" else binding.bind_output
    entry = [rows if bound_rows is None else bound_rows, *shape[2:]]
    for j, name in enumerate(contract.decode_state_names(state, prefix)):
        bind(name, device, 0, dtype, entry, base + j * nbytes)


def run_chunk_bound(
    session: ort.InferenceSession,
    contract: ShapeContract,
    device: str,
    feeds: dict[str, np.ndarray],
    states: dict[str, ort.OrtValue],
    options: ort.RunOptions | None = None,
) -> tuple[np.ndarray, dict[str, ort.OrtValue], np.ndarray | None]:
    """One run of a chunk graph with IOBinding: the host ``feeds``, the past ``states``
    (``present_*`` OrtValues on ``device``) bound as inputs; the conv and recurrent outputs in new
    buffers (:func:`bind_state_output`); the KV cache written in place in ``states['present_kv_cache']`` with
    :attr:`ShapeContract.kv_in_place` (a new buffer otherwise); ``options``: the run's RunOptions
    (:func:`.sessions.run_options`). Returns the logits (host), the new states and in an export with draft tokens
    the hidden states of every position (host; else None)."""
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, np.ascontiguousarray(value))
    binding.bind_output("logits", device)
    hidden = bool(contract.draft_tokens)
    if hidden:
        binding.bind_output("hidden_states", device)
    first = 2 if hidden else 1  # the outputs before the states
    if not contract.kv_in_place:
        graph_outputs = {o.name: o for o in session.get_outputs()}
        for state in STATE_NAMES:
            past = states[f"present_{state}"]
            binding.bind_ortvalue_input(f"past_{state}", past)
            bind_state_output(binding, graph_outputs[f"present_{state}"], device, past.shape())  # (the same shape)
        session.run_with_iobinding(binding, options)
        values = binding.get_outputs()
        outputs = dict(zip((f"present_{s}" for s in STATE_NAMES), values[first:]))
        return values[0].numpy(), outputs, values[1].numpy() if hidden else None
    new = {}
    for state in STATE_NAMES[:2]:
        shape, dtype = contract.state_shape(state), NP_DTYPES[contract.state_dtype(state)]
        new[f"present_{state}"] = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0)
        bind_entries(binding, contract, device, state, "past", states[f"present_{state}"])
        bind_entries(binding, contract, device, state, "present", new[f"present_{state}"])
    kv = new["present_kv_cache"] = states["present_kv_cache"]
    bind_entries(binding, contract, device, "kv_cache", "past", kv)
    bind_entries(binding, contract, device, "kv_cache", "present", kv)  # in place
    session.run_with_iobinding(binding, options)
    values = binding.get_outputs()
    return values[0].numpy(), new, values[1].numpy() if hidden else None


def run_host(
    session: ort.InferenceSession,
    contract: ShapeContract,
    feeds: dict[str, np.ndarray],
    states: dict,
    options: ort.RunOptions | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
    """One run of a decode or chunk graph with every state through numpy (``--host-state-roundtrip``):
    the host ``feeds`` and the past ``states`` (``present_*``, stacked; split into entries where the
    graph takes them one by one) in; the logits, the new stacked states and the hidden states (a chunk graph of an
    export with draft tokens; else None) out; ``options``: the
    run's RunOptions."""
    outputs = run_host_outputs(session, contract, feeds, states, options)
    new = {f"present_{state}": host_present(contract, outputs, state) for state in STATE_NAMES}
    return outputs["logits"], new, outputs.get("hidden_states")


def run_host_outputs(
    session: ort.InferenceSession,
    contract: ShapeContract,
    feeds: dict[str, np.ndarray],
    states: dict,
    options: ort.RunOptions | None = None,
) -> dict[str, np.ndarray]:
    """Run ``session`` on the host ``feeds`` and the past ``states`` (``present_*``, stacked; split into entries
    where the graph takes them one by one); returns every output by name (host arrays)."""
    feeds = dict(feeds)
    for state in STATE_NAMES:
        names = contract.decode_state_names(state, "past")
        value = _to_numpy(states[f"present_{state}"])
        feeds.update(zip(names, value) if contract.kv_in_place else {names[0]: value})
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds, options)))


def host_present(contract: ShapeContract, outputs: dict[str, np.ndarray], state: str) -> np.ndarray:
    """The stacked present ``state`` among a host run's ``outputs`` (its entries stacked where the graph returns
    them one by one)."""
    names = contract.decode_state_names(state, "present")
    return np.stack([outputs[n] for n in names]) if contract.kv_in_place else outputs[names[0]]


class HostDecoder:
    """Copy-to-host fallback: every state goes through numpy between steps (the stacked KV
    cache is split into and rebuilt from its entries when the graph takes them one by one)."""

    def __init__(self, decode: GraphSession, contract: ShapeContract, states: dict[str, ort.OrtValue | np.ndarray]):
        self.session = decode.session
        self.contract = contract
        self.past = {name: _to_numpy(states[f"present_{name}"]) for name in STATE_NAMES}

    def states(self) -> dict[str, np.ndarray]:
        """The states after the last step, as host arrays (this decoder's own)."""
        return {f"present_{name}": value for name, value in self.past.items()}

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        active_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one decode step over ``R = len(input_ids)`` rows (the first ``R`` slots where the graph's row axis is
        dynamic); returns logits ``[R, 1, V]`` fp32."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if active_rows is not None:
            feeds["active_rows"] = active_rows
        rows = int(input_ids.shape[0])
        past = {name: value[:, :rows] for name, value in self.states().items()}  # (all of them but with fewer rows)
        logits, states, _ = run_host(self.session, self.contract, feeds, past)
        for name in STATE_NAMES:
            new = states[f"present_{name}"]
            if rows == self.past[name].shape[1]:
                self.past[name] = new
            else:
                self.past[name] = self.past[name].copy()  # the rows in use updated, the others kept
                self.past[name][:, :rows] = new
        return logits


def _to_numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)
