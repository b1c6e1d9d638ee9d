"""Rate of the CPU int4 matrix-product kernels on this machine, at one prefill-shaped product.

Not part of the test suite. One product ``[M, K] x [K, N]`` fp32 activations, int4 weights in blocks
of 32 along K (fp32 scales, symmetric), random values, on 2 threads by default, three kernels:

- ONNX Runtime ``MatMulNBits`` (``com.microsoft``), ``accuracy_level=4``: activations quantized to
  int8 per block (the exports' setting, ``--ops ort``);
- the same with ``accuracy_level=1``: fp32 activations against dequantized weights;
- OpenVINO CPU, the portable form (``DequantizeLinear`` int4 with ``block_size=32`` then ``MatMul``,
  ``--ops portable``), ``INFERENCE_PRECISION_HINT`` f32.

Each kernel runs ``--warmup`` times, then the kernels alternate for ``--rounds`` rounds; the table
gives the best and every round in ms, and GFLOP/s (``2 M K N`` over the best). Issue 19 used it to
read the 4B prefill's miss on a CPU without VNNI (``benchmarks/README.md``, "a CPU without VNNI").

Usage (from the repository root, in the development environment)::

    .venv/bin/python benchmarks/int4_kernel_rate.py [--m 512] [--k 2560] [--n 18432] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qwen35_onnx.bench.protocol import int4_product_model

BLOCK = 32


def dequantize_model(k: int, n: int, rng: np.random.Generator) -> onnx.ModelProto:
    """The portable form: ``DequantizeLinear`` of int4 ``[K, N]`` (blocks of 32 along K, scales
    ``[K / 32, N]`` fp32) feeding ``MatMul`` (``x [M, K]`` fp32, M dynamic)."""
    codes = rng.integers(-8, 8, size=(k, n), dtype=np.int8).astype(ml_dtypes.int4)  # ONNX's INT4 packing
    scales = rng.random((k // BLOCK, n), dtype=np.float32) * 0.01
    nodes = [
        helper.make_node("DequantizeLinear", ["weight", "scales"], ["dense"], axis=0, block_size=BLOCK),
        helper.make_node("MatMul", ["x", "dense"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "int4_product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(codes, "weight"), numpy_helper.from_array(scales, "scales")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def kernels(k: int, n: int, threads: int, folder: Path) -> dict[str, Callable[[np.ndarray], object]]:
    """Name -> a function running the product on ``x [M, K]`` fp32, for each kernel available (the
    OpenVINO one only where ``openvino`` is installed)."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    runs: dict[str, Callable[[np.ndarray], object]] = {}
    for level in (4, 1):
        model = int4_product_model(k, n, block_size=BLOCK, accuracy_level=level, tokens="M")
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        runs[f"onnxruntime {ort.__version__} MatMulNBits, accuracy level {level}"] = lambda x, session=session: (
            session.run(None, {"a": x})
        )
    try:
        import openvino as ov
    except ImportError:
        return runs
    path = folder / "dequantize_matmul.onnx"
    onnx.save(dequantize_model(k, n, rng), path)
    compiled = ov.Core().compile_model(
        str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads}
    )
    request = compiled.create_infer_request()
    runs[f"openvino {ov.__version__.split('-')[0]} DequantizeLinear + MatMul, f32"] = lambda x: request.infer({0: x})
    return runs


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=positive, default=512, help="rows of the activations (tokens)")
    parser.add_argument("--k", type=positive, default=2560, help="inner dimension, a multiple of 32 (4B: hidden 2560)")
    parser.add_argument("--n", type=positive, default=18432, help="output columns (4B: gate + up, 2 x 9216)")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each kernel first (>= 0)")
    parser.add_argument("--rounds", type=positive, default=4)
    args = parser.parse_args()
    if args.k % BLOCK:
        parser.error(f"--k {args.k} is not a multiple of the block size {BLOCK}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    x = np.random.default_rng(1).standard_normal((args.m, args.k), dtype=np.float32)
    with tempfile.TemporaryDirectory() as folder:
        runs = kernels(args.k, args.n, args.threads, Path(folder))
        for run in runs.values():
            for _ in range(args.warmup):
                run(x)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run(x)
                times[name].append(1e3 * (time.perf_counter() - start))
    flop = 2 * args.m * args.k * args.n
    print(f"[{args.m}, {args.k}] x [{args.k}, {args.n}], int4 block {BLOCK}, {args.threads} threads")
    print("| kernel | best ms | rounds ms | GFLOP/s |\n|---|---:|---|---:|")
    for name, values in times.items():
        best = min(values)
        print(f"| {name} | {best:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {flop / best / 1e6:.0f} |")


if __name__ == "__main__":
    main()
