"""Weights for a memory-bounded export: the model is traced with empty parameters and each
weight is read from the checkpoint only when the graph's weights file is written.

- :func:`empty_model` builds ``Qwen3_5ForConditionalGeneration`` with uninitialized
  parameters (allocated, never written, so never resident) and no weight initialisation; the
  buffers computed from the config (the rotary ``inv_freq``) are real. Tracing needs only
  shapes and dtypes, so a graph of any size traces in a few hundred MB.
- :class:`CheckpointWeights` reads one tensor at a time from the checkpoint's safetensors
  file(s) (one file, or shards listed by ``model.safetensors.index.json``), in the dtype it
  stores, and converts it to the export's dtype.

Together they bound the export's memory by the largest tensor (plus its quantization
temporaries) instead of the model: Qwen3.5-4B is 9.1 GB in bf16 and 18 GB in fp32.
"""

from __future__ import annotations

import copy
import json
import resource
from pathlib import Path

import torch
from torch import nn  # noqa: F401  (parameter_names' annotation)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightsError(ValueError):
    """The checkpoint's weight files are missing, unreadable, or lack a tensor the graph needs."""


def empty_model(config, dtype: torch.dtype):
    """``Qwen3_5ForConditionalGeneration(config)`` in eval mode with uninitialized parameters in
    ``dtype`` (transformers' ``no_init_weights``: ``torch.empty`` storage that nothing writes,
    so the operating system never makes it resident; float buffers such as ``inv_freq`` are
    built as ``from_pretrained(dtype=...)`` builds them). The model and its vision tower get
    ``empty_weights = True``, which tells the graph modules not to compute constants from
    the parameters (see :func:`.graphs.register_derived`).
    """
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(config)
    for sub in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if sub is not None:  # the submodels are built in their config's dtype when it names one
            sub.dtype = dtype
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            model = Qwen3_5ForConditionalGeneration(config)
        model.tie_weights()  # as from_pretrained does (no_init_weights skips it): a tied lm_head is the embedding
    finally:
        torch.set_default_dtype(default)
    model.empty_weights = model.model.visual.empty_weights = True
    return model.eval()


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``model`` (names as in its state dict,
    which are the checkpoint's keys; a tied parameter keeps its first name, e.g. the token
    embedding's for a tied lm_head)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


class CheckpointWeights:
    """Tensors of a local Hugging Face checkpoint, read one at a time (safetensors memory-maps
    the file; only the tensor asked for is read) and converted to ``dtype``.

    A tied lm_head needs no ``lm_head.weight``: the empty model's tied parameter is named after
    the embedding (:func:`parameter_names`).

    Raises (constructor):
        WeightsError: no ``model.safetensors`` (nor an index of shards), or a file that is not
            safetensors.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype):
        from safetensors import safe_open

        self.model_dir, self.dtype = Path(model_dir), dtype
        index = self.model_dir / SAFETENSORS_INDEX
        try:
            if (self.model_dir / SAFETENSORS_FILE).is_file():
                files = [SAFETENSORS_FILE]
            elif index.is_file():
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            else:
                raise WeightsError(f"{str(self.model_dir)!r} has no {SAFETENSORS_FILE} (nor {SAFETENSORS_INDEX})")
            self._where: dict[str, Path] = {}
            for name in files:
                with safe_open(self.model_dir / name, framework="pt") as f:
                    self._where.update(dict.fromkeys(f.keys(), self.model_dir / name))
        except WeightsError:
            raise
        except Exception as exc:  # OSError, SafetensorError, a broken index
            raise WeightsError(f"the weights of {str(self.model_dir)!r} cannot be read: {exc}") from exc

    def tensor(self, name: str) -> torch.Tensor:
        """The checkpoint tensor ``name`` in the export's dtype (floating tensors only are
        converted), contiguous. The file is opened for this tensor only (safetensors maps it
        into memory; closing it unmaps the pages read, so they do not stay resident).

        Raises:
            WeightsError: the checkpoint has no tensor ``name``, or
                its file cannot be read.
        """
        from safetensors import safe_open

        key = name
        if key not in self._where:
            raise WeightsError(f"the checkpoint {str(self.model_dir)!r} has no tensor {name!r}")
        try:
            with safe_open(self._where[key], framework="pt") as f:
                value = f.get_tensor(key)
        except Exception as exc:  # the file changed or broke since the export started
            raise WeightsError(f"tensor {key!r} of {str(self._where[key])!r} cannot be read: {exc}") from exc
        if value.is_floating_point() and value.dtype != self.dtype:
            value = value.to(self.dtype)
        return value.contiguous()


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far, in bytes (``getrusage`` ``ru_maxrss``,
    which Linux reports in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
