"""One copy of the text weights for all ONNX Runtime sessions of an export (issue 9 item 4).

- Memory: on an export whose text weights (214 MB) dominate the noise, loading and running
  more prefill buckets adds far less than one weight set of resident memory, while one more
  session loaded the ONNX Runtime default way (its own copy) adds most of a weight set. Measured
  in a fresh process (``/proc/self/status`` VmRSS).
- Results: logits (the wide export) and greedy tokens (fp32 portable, fp32 and int4 ort) are
  those of sessions that each hold their own weights.
- The wire-format graph editor keeps an unedited model byte for byte and writes graphs the
  ``onnx`` package reads back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.onnxruntime.backend import OrtBackend

from .conftest import MAX_NEW_TOKENS, PROMPT, export_to


def unshared(pipe: Pipeline) -> Pipeline:
    """The same export with every session holding its own weights (ONNX Runtime's default)."""
    return Pipeline(
        pipe.root, pipe.contract, OrtBackend(pipe.root, pipe.contract, share_weights=False), pipe.preprocessor
    )


@pytest.fixture(scope="module")
def wide_export(wide_checkpoint, tmp_path_factory) -> Path:
    """The wide checkpoint (214 MB of fp32 text weights), ``--ops ort``, buckets 32 / 64 / 128."""
    return export_to(wide_checkpoint, tmp_path_factory.mktemp("exp") / "wide", ops="ort", prefill_buckets=(32, 64, 128))


MEASURE = r"""
import json, sys
import numpy as np
from pathlib import Path
from qwen35_onnx.bench.memory import resident
from qwen35_onnx.onnxfile.edit import read_model
from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.onnxruntime.sessions import GraphSession, session_config

pipe = Pipeline.from_exported(sys.argv[1])
c = pipe.contract
zeros = np.zeros((c.n_image_rows, c.image_embed_dim), dtype=np.float32)
rng = np.random.default_rng(0)
figures = []
generations = []
for bucket in c.prefill_buckets:  # load, then run: prefill reads every text weight
    prepared = pipe.prepare_ids(rng.integers(0, 1000, size=(1, bucket - 4)))
    generations.append(pipe.generation(prepared))
    logits = generations[-1].prefill()
    if not figures:
        generations[-1].step(int(np.argmax(logits)))  # decode's buffers too, before the first figure
    figures.append(resident())
key = c.prefill_graph_key(c.prefill_buckets[-1])
own = GraphSession.load(key, Path(sys.argv[1]) / c.graphs[key], config=session_config(c), dtype=c.dtype)
padded = prepared.padded(c.pad_token_id)
own.session.run(None, dict(zip(("input_ids", "attention_mask", "position_ids"), padded), image_embeds=zeros))
figures.append(resident())
found = {"rss": [f["VmRSS"] for f in figures], "pss": [f["Pss"] for f in figures]}
if pipe.backend.graphs.weights is not None:
    found["weights"] = pipe.backend.graphs.weights.mapped_bytes()
if pipe.backend.graphs.prepacked is not None:  # bytes of the packed blobs one session reads
    saved = read_model((pipe.backend.graphs.prepacked.path / f"{key}.onnx").read_bytes())
    found["packed"] = sum(int(blob.split(";")[1]) for t in saved.initializers.values() for k, v in t.external
                          if k.startswith("prepacked") for blob in v.split("|")[1:])
print(json.dumps(found))
"""


def test_more_buckets_add_far_less_than_a_weight_set(wide_export):
    """Buckets 64 and 128 loaded and run after bucket 32 add < 10 % of the text weights each;
    a session of the same graph with its own weights (the control) adds > 50 %."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(wide_export)], capture_output=True, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    rss, weights = found["rss"], found["weights"]
    assert weights == (wide_export / "text" / "weights.data").stat().st_size > 200e6
    steps = np.diff(rss)
    report = (
        f"resident memory after each bucket, then the control: {[round(r / 1e6) for r in rss]} MB; "
        f"weights {weights / 1e6:.0f} MB"
    )
    assert all(step < 0.1 * weights for step in steps[:-1]), report
    assert steps[-1] > 0.5 * weights, report


def test_wide_export_logits_and_relayout(wide_export):
    """The shared, re-laid-out sessions give the logits of sessions with their own weights; the
    narrow weights (the MLP's down projections among them) and the tied lm_head are held
    transposed, once however many buckets load."""
    pipe = Pipeline.from_exported(wide_export)
    weights = pipe.backend.graphs.weights
    assert weights.relayout
    c = pipe.contract
    down_and_lm_head = 4 * ((c.n_linear + c.n_full) * 4096 * 512 + c.vocab_size * 512)
    transposed = weights.transposed_bytes()
    assert down_and_lm_head <= transposed < 0.8 * weights.mapped_bytes()
    own = unshared(pipe)
    prepared = pipe.prepare_ids(np.random.default_rng(1).integers(0, 1000, size=(1, 50)))
    shared_run, own_run = pipe.generation(prepared), own.generation(prepared)
    a, b = shared_run.prefill(), own_run.prefill()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    token = int(np.argmax(b))
    step_a, step_b = shared_run.step(token), own_run.step(token)
    np.testing.assert_allclose(step_a, step_b, rtol=1e-4, atol=1e-4 * float(np.abs(step_b).max()))
    for bucket in c.prefill_buckets:
        pipe.backend.graphs.prefill(bucket)
    assert weights.transposed_bytes() == transposed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["portable fp32", "ort fp32", "ort int4"])
def test_tokens_unchanged_by_sharing(kind, fixed_export, trained_export, photo):
    """Greedy tokens of the demo prompt with the shared weights equal those of sessions that hold
    their own weights (fp32: unpacked and re-laid-out against pre-packed; int4: the pre-packed
    weights cache against each session's own packing). The ort exports are the trained
    checkpoint's (shared with the quantization tests)."""
    exports = {
        "portable fp32": lambda: fixed_export,
        "ort fp32": lambda: trained_export("ort"),
        "ort int4": lambda: trained_export("ort", quantize="int4"),
    }
    pipe = Pipeline.from_exported(exports[kind]())
    if "fp32" in kind:
        assert pipe.backend.graphs.weights.relayout and pipe.backend.graphs.prepacked is None
    else:
        assert pipe.backend.graphs.weights is None and pipe.backend.graphs.prepacked is not None
    prepared = pipe.prepare(photo, PROMPT)
    shared = pipe.generate_prepared(prepared, max_new_tokens=MAX_NEW_TOKENS).token_ids
    own = unshared(pipe).generate_prepared(prepared, max_new_tokens=MAX_NEW_TOKENS).token_ids
    assert shared == own
    assert len(shared) > 10


def test_graph_editor_round_trip(fixed_export):
    """An unedited model is written back byte for byte; an edited one (a MatMul replaced, an
    initializer dropped and one added, a domain imported) is a valid model for ``onnx``."""
    import onnx

    from qwen35_onnx.onnxfile.edit import Initializer, Node, read_model, write_model

    path = fixed_export / "text" / "decode.onnx"
    data = path.read_bytes()
    model = read_model(data)
    assert write_model(model) == data
    index, node = next(
        (i, n)
        for i, n in enumerate(model.nodes)
        if n.op_type == "MatMul" and model.initializers.get(n.inputs[1]) and model.initializers[n.inputs[1]].location
    )
    weight = model.initializers[node.inputs[1]]
    added = Initializer("w_t", weight.dims[::-1], weight.data_type, weight.location, weight.offset, weight.length)
    edited = write_model(
        model,
        {
            index: Node(
                "FusedMatMul", [node.inputs[0], "w_t"], node.outputs, node.name, "com.microsoft", {"transB": [1]}
            )
        },
        drop={weight.name},
        add=[added],
        domains={"com.microsoft": 1},
    )
    proto = onnx.load_from_string(edited)
    assert proto.graph.node[index].op_type == "FusedMatMul"
    assert proto.graph.node[index].attribute[0].name == "transB" and proto.graph.node[index].attribute[0].i == 1
    names = {t.name for t in proto.graph.initializer}
    assert "w_t" in names and weight.name not in names
    assert {o.domain for o in proto.opset_import} >= {"", "com.microsoft"}
    new = next(t for t in proto.graph.initializer if t.name == "w_t")
    assert list(new.dims) == list(weight.dims[::-1])
    assert {e.key: e.value for e in new.external_data}["offset"] == str(weight.offset)


def test_prefill_sessions_that_pack_their_own_weights_are_bounded(wide_int4_export, trained_export, monkeypatch):
    """Without the pre-packed weights cache (or where it cannot be used), a quantized export's
    prefill sessions each hold their own pre-packed weights: at most
    ``max_prefill_sessions`` stay loaded, and under memory pressure (``MemAvailable`` below one
    more session's weights) the least recently used go first; a dropped bucket loads again and
    gives the same logits."""
    from qwen35_onnx.runtime.onnxruntime import sessions

    out = wide_int4_export
    base = Pipeline.from_exported(out)
    contract, preprocessor = base.contract, base.preprocessor
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, 1000, size=(1, b - 4)) for b in (32, 64, 128)}

    def logits(pipe, bucket):
        return pipe.generation(pipe.prepare_ids(prompts[bucket])).prefill()

    pipe = Pipeline(
        out, contract, OrtBackend(out, contract, max_prefill_sessions=2, prepacked_cache=False), preprocessor
    )
    graphs = pipe.backend.graphs
    assert graphs.packs_per_session and graphs.session_cost() > 0
    first = logits(pipe, 32)
    logits(pipe, 64)
    logits(pipe, 32)  # 32 is now the most recently used
    logits(pipe, 128)
    assert list(graphs._prefill) == [32, 128]  # 64 was dropped
    logits(pipe, 64)
    assert list(graphs._prefill) == [128, 64]
    np.testing.assert_array_equal(logits(pipe, 32), first)  # loaded again, same result

    # no fixed bound, but no memory for one more session: only the new one stays
    monkeypatch.setattr(sessions, "available_memory", lambda: graphs.session_cost())
    unbounded = Pipeline(out, contract, OrtBackend(out, contract, prepacked_cache=False), preprocessor)
    for bucket in (32, 64, 128):
        logits(unbounded, bucket)
        assert list(unbounded.backend.graphs._prefill) == [bucket]
    with pytest.raises(ValueError, match="max_prefill_sessions must be None or an integer >= 1, got 0"):
        OrtBackend(out, contract, max_prefill_sessions=0)
    assert not base.backend.graphs.packs_per_session  # with the cache (the default) the sessions share their weights
    cached = Pipeline(out, contract, OrtBackend(out, contract, max_prefill_sessions=1), preprocessor)
    logits(cached, 32)
    np.testing.assert_array_equal(logits(cached, 64), logits(pipe, 64))
    assert list(cached.backend.graphs._prefill) == [64]  # the fixed bound holds with the cache too

    # fp32 exports share the mapped weights: nothing to bound
    assert not Pipeline.from_exported(trained_export("ort")).backend.graphs.packs_per_session


FAULTS = r"""
import json, resource, sys
import numpy as np
from qwen35_onnx.pipeline import Pipeline
pipe = Pipeline.from_exported(sys.argv[1])
prepared = pipe.prepare_ids(np.random.default_rng(0).integers(0, 1000, size=(1, 120)))
pipe.generation(prepared).prefill()  # loads the bucket; the arena grows to what a run needs
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pipe.generation(prepared).prefill()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
graphs = pipe.backend.graphs
options = {key: spec.session.get_session_options() for key, spec in
           [("decode", graphs.decode), ("vision", graphs.vision(None)), *graphs._prefill.items()]}

def shared(o):
    try:
        return o.get_session_config_entry("session.use_env_allocators")
    except RuntimeError:  # not set
        return ""
found = {str(k): [o.enable_mem_pattern, shared(o)] for k, o in options.items()}
print(json.dumps({"faults": faults, "options": found}))
"""


def test_prefill_runs_reuse_the_shared_arena(wide_int4_export):
    """Prefill sessions take their activations from the process's one shared CPU arena, tensor by
    tensor (no memory pattern), so a repeated 120-token prefill writes to memory already mapped:
    a few page faults, where a session without an arena faulted in 3,600-4,000 fresh pages every
    other run on this export (0.8B at 512 tokens: 111,000, 20-25 % of the prefill); decode keeps its own
    arena. Long runs hand what they added back (:func:`run_options`)."""
    from qwen35_onnx.runtime.onnxruntime.sessions import KEPT_ACTIVATION_TOKENS, run_options

    out = subprocess.run([sys.executable, "-c", FAULTS, str(wide_int4_export)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert sum(found["faults"]) < 3000, found  # 7 runs: 800-1,100 measured; 7,600-11,700 without an arena
    assert found["options"] == {"decode": [True, ""], "vision": [False, "1"], "128": [False, "1"]}, found
    assert run_options(KEPT_ACTIVATION_TOKENS) is None
    shrink = run_options(KEPT_ACTIVATION_TOKENS + 1)
    assert shrink.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
