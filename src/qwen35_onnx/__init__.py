"""qwen35-onnx: export Qwen3.5 vision-language checkpoints to fixed-shape ONNX graphs and
run them with ONNX Runtime."""

__version__ = "0.16.0"
