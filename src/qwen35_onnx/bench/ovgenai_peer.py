"""OpenVINO's own pipeline measured inside its own virtual environment (a script: ``python -P
ovgenai_peer.py`` reads a JSON spec on stdin and prints a JSON result as its last line). It runs
where this project is not installed, so it imports the standard library and openvino_genai only;
:func:`qwen35_onnx.bench.peers.bench_ovgenai` runs it."""

from __future__ import annotations

import json
import statistics
import sys
import time


def ovgenai_peer(spec: dict) -> dict:
    """Measure openvino-genai's ``VLMPipeline`` as ``spec`` says (model folder, precision hint, the
    bench protocol's counts, the prompts' token ids by length). Per length: a text-only prompt of
    exactly that many tokens (the random ids of the other peers decoded by the pipeline's tokenizer
    and re-encoded, one id trimmed or added per try until the count matches, else one token
    repeated; no chat template; each run a different rotation of the ids, so that the pipeline's
    prefix cache cannot serve it); prefill = median time to first token (``perf_metrics.get_ttft()``)
    of the protocol's one-token generations after its warm-ups; decode = one generation of 1 +
    warm-up + timed tokens (``ignore_eos``), median of the timed token times
    (``raw_metrics.m_durations``: the times between consecutive tokens, in microseconds;
    ``get_tpot()``, their mean with the warm-ups, is reported too); end to end = the protocol's
    generated tokens / wall time of ``generate`` from the shortest prompt."""
    import openvino_genai as og

    pipe = og.VLMPipeline(spec["model_dir"], "CPU", INFERENCE_PRECISION_HINT=spec["precision"])
    tokenizer = pipe.get_tokenizer()

    def count(text: str) -> int:
        return int(tokenizer.encode(text).input_ids.get_shape()[1])

    def prompt_of(ids: list[int], length: int) -> str:
        base, ids = list(ids), list(ids)
        for i in range(4 * length):  # one id more or less per try, until the count matches
            n = count(tokenizer.decode(ids))
            if n == length:
                return tokenizer.decode(ids)
            ids = ids[:-1] if n > length else ids + [base[i % len(base)]]
        for token in base:  # fallback: one token repeated, when it does not merge with itself
            text = tokenizer.decode([token]) * length
            if count(text) == length:
                return text
        raise RuntimeError(f"no prompt of exactly {length} tokens found")

    def generate(text: str, new_tokens: int):
        config = og.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.ignore_eos, config.do_sample, config.apply_chat_template = True, False, False
        return pipe.generate(text, images=[], generation_config=config)

    out = {
        "prefill_ms": {},
        "decode_ms": {},
        "tpot_ms": {},
        "input_tokens": {},
        "versions": {"openvino_genai": og.__version__},
    }
    protocol = spec["protocol"]
    warmup, runs = protocol["prefill_warmup"], protocol["prefill_runs"]
    decode_warmup, decode_runs, e2e_tokens = protocol["decode_warmup"], protocol["decode_runs"], protocol["e2e_tokens"]
    for length, ids in spec["prompts"].items():
        # each run its own rotation of the ids: a repeated prompt would come from the pipeline's
        # prefix cache (on by default), its time to first token then that of one token
        texts = [prompt_of(ids[i:] + ids[:i], int(length)) for i in range(warmup + runs + 1)]
        ttft = []
        for i in range(warmup + runs):
            metrics = generate(texts[i], 1).perf_metrics
            if i >= warmup:
                ttft.append(metrics.get_ttft().mean)
        metrics = generate(texts[-1], 1 + decode_warmup + decode_runs).perf_metrics
        # m_durations: microseconds between consecutive tokens (the first token's time is the TTFT)
        steps = list(metrics.raw_metrics.m_durations)[decode_warmup:]
        if len(steps) != decode_runs:
            raise RuntimeError(f"expected {decode_runs} decode times after the warm-ups, got {len(steps)}")
        out["prefill_ms"][length] = statistics.median(ttft)
        out["decode_ms"][length] = statistics.median(steps) / 1000  # microseconds
        out["tpot_ms"][length] = metrics.get_tpot().mean
        out["input_tokens"][length] = metrics.get_num_input_tokens()
    first = min(spec["prompts"], key=int)
    text = prompt_of(spec["prompts"][first], int(first))
    start = time.perf_counter()
    metrics = generate(text, e2e_tokens).perf_metrics
    out["e2e_tokens_per_s"] = metrics.get_num_generated_tokens() / (time.perf_counter() - start)
    if spec.get("image"):
        out["image"] = image_ttft(og, spec["model_dir"], spec["precision"], spec["image"], warmup, runs)
    with open("/proc/self/status") as status:  # VmHWM: this process's peak resident memory (kB)
        out["peak_rss_bytes"] = next(
            (int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")), None
        )
    return out


def image_ttft(og, model_dir: str, precision: str, image: dict, warmup: int, runs: int) -> dict:
    """Time to first token (median ms of ``runs`` after ``warmup``) of ``image["question"]`` about the
    picture at ``image["path"]`` (a ``.npy`` of ``[H, W, 3]`` uint8 RGB: the peer's environment has no
    image library) through ``VLMPipeline.generate`` with its chat template, on a pipeline
    whose prefix cache is off (the same picture and question every run would come from the cache);
    also the prompt's token count as the pipeline reports it."""
    return _media_ttft(og, model_dir, precision, image, warmup, runs, "images")


def video_ttft(og, model_dir: str, precision: str, video: dict, warmup: int, runs: int) -> dict:
    """As :func:`image_ttft` for a video: ``video["path"]``, a ``.npy`` of the sampled frames ``[T, H, W, 3]``
    uint8 RGB, through ``VLMPipeline.generate(..., videos=[frames])``."""
    return {
        **_media_ttft(og, model_dir, precision, video, warmup, runs, "videos"),
        "versions": {"openvino_genai": og.__version__},
    }


def _media_ttft(og, model_dir: str, precision: str, media: dict, warmup: int, runs: int, kind: str) -> dict:
    """:func:`image_ttft` (``kind`` "images": the array gets a leading frame axis) or :func:`video_ttft` ("videos")."""
    import numpy as np
    import openvino as ov

    scheduler = og.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    pipe = og.VLMPipeline(model_dir, "CPU", scheduler_config=scheduler, INFERENCE_PRECISION_HINT=precision)
    array = np.load(media["path"])
    tensor = ov.Tensor(np.ascontiguousarray(array[None] if kind == "images" else array))  # [T, H, W, 3] uint8 RGB
    config = og.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = 1
    config.do_sample = False
    ttft, tokens = [], None
    for i in range(warmup + runs):
        metrics = pipe.generate(media["question"], generation_config=config, **{kind: [tensor]}).perf_metrics
        tokens = metrics.get_num_input_tokens()
        if i >= warmup:
            ttft.append(metrics.get_ttft().mean)
    return {"ttft_ms": statistics.median(ttft), "prompt_tokens": tokens}


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    if request.get("video_only"):  # benchmarks/video_bench.py: the video question alone
        import openvino_genai

        video = request["video"]
        result = video_ttft(
            openvino_genai, request["model_dir"], request["precision"], video, video["warmup"], video["runs"]
        )
        print(json.dumps(result))
    else:
        print(json.dumps(ovgenai_peer(request)))
