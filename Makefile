# `make demo`: set up, then the main job on the built-in demo checkpoint.
# `make test`: set up, lint (ruff), build the docs site (strict), then the whole test suite (slow tests included).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch 2.13.0 (export and verification only), from the package index: on Linux x86-64 PyPI's wheel is the CUDA
# build (with its nvidia-* packages), run on the CPU here. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# makes pip take the CPU-only build, 2.13.0+cpu (a local version label that == 2.13.0 matches and pip prefers).
TORCH ?= torch==2.13.0

.PHONY: setup setup-both demo lint docs test test-fast bench clean

setup: $(STAMP)

# --no-compile: Python compiles what it imports on first use instead of every installed file at install.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile "$(TORCH)"
	$(PY) -m pip install --quiet --no-compile -e ".[export,test,serve,cluster,openvino,docs,video]"
	touch $(STAMP)

# The reference for the video tests: transformers' Qwen3VLVideoProcessor needs torchvision, and the PyPI
# torchvision wheels need torch 2.14.1 (a CUDA build, about 5.5 GB, CPU-run here): a second environment beside
# the one above, used only by tests/video_reference.py and the `verify --video` test (tests/test_video.py).
REF_VENV ?= .venv-video-ref
REF_STAMP := $(REF_VENV)/.installed

# Its torch (the long part) installs while $(STAMP) does (`make test`: make -j2); the project and the main
# environment's transformers after that (setuptools writes src/*.egg-info: one editable install at a time).
REF_TORCH := $(REF_VENV)/.torch

$(REF_TORCH):
	test -x $(REF_VENV)/bin/python || python3 -m venv $(REF_VENV)
	$(REF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(REF_VENV)/bin/python -m pip install --quiet --no-compile torch==2.14.1 torchvision==0.29.1
	touch $(REF_TORCH)

$(REF_STAMP): $(REF_TORCH) $(STAMP)
	$(REF_VENV)/bin/python -m pip install --quiet --no-compile -e ".[video]" \
		"transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"
	touch $(REF_STAMP)

demo: $(STAMP)
	$(VENV)/bin/qwen35-onnx demo

# The suite runs on two workers, each test file on one of them (session fixtures build shared
# checkpoints and exports once for both: tests/conftest.py), the costliest files first (conftest's HEAVY_FIRST).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

# The documentation site, offline and strict (a broken link, reference or docstring fails it): the CLI
# reference is generated from the typer declarations first, so it cannot drift from the code.
docs: $(STAMP)
	$(PY) -m typer qwen35_onnx.cli utils docs --name qwen35-onnx --title "CLI reference" --output docs/reference/cli.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The two environments' set-up side by side (from a fresh clone the suite started 82 s after the clone instead
# of 100 s, AMD EPYC 2 cores), then the rest.
setup-both:
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(STAMP) $(REF_TORCH)

test: setup-both
	@$(MAKE) --no-print-directory lint docs $(REF_STAMP)
	$(PYTEST)

test-fast: setup-both
	@$(MAKE) --no-print-directory lint $(REF_STAMP)
	$(PYTEST) -m "not slow"

# Speed side by side (not a test): writes benchmarks/out/PRESET/bench.{md,json,png}. OpenVINO's own
# pipeline (optimum-intel + openvino-genai) runs from benchmarks/out/.venv-optimum, which the bench
# creates on its first run (pins in src/qwen35_onnx/bench/peers.py).
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[export,bench]"
	$(VENV)/bin/qwen35-onnx bench

clean:
	rm -rf $(VENV) $(REF_VENV) .pytest_cache .hypothesis site
