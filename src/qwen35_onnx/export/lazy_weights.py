"""Lazy weights of a traced graph: every initializer that was traced from an empty parameter
(or a constant computed from parameters) becomes a :class:`SourcedTensor`, a tensor computed only
when it is written, from the checkpoint (:class:`~.weight_source.CheckpointWeights`) and the graph module's recipes
(:func:`.graphs.register_derived`).

A SourcedTensor carries a ``key`` naming where its value comes from (checkpoint tensor,
transform, dtype), so the writer of the shared weights file (:mod:`.weights`) stores a tensor
used by several graphs once without computing it again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.tensor_adapters import TorchTensor
from torch import nn

from .weight_source import CheckpointWeights, WeightsError, parameter_names


class SourcedTensor(ir.LazyTensor):
    """An ``ir.LazyTensor`` (computed on every read, never cached) with a ``key`` that
    identifies its value: two SourcedTensors with equal keys hold equal values."""

    def __init__(self, func: Callable[[], ir.TensorProtocol], dtype: ir.DataType, shape, key: Hashable, name: str):
        super().__init__(func, dtype=dtype, shape=ir.Shape(shape), name=name)
        self.key = key
        self.compute = func
        """The function giving the value (a ``TorchTensor`` for weights read from the checkpoint)."""


def torch_tensor(value: torch.Tensor) -> ir.TensorProtocol:
    """``value`` as an ONNX IR tensor without a copy."""
    return TorchTensor(value.contiguous())


def numpy_tensor(value: np.ndarray, dtype: ir.DataType | None = None) -> ir.TensorProtocol:
    """``value`` as an ONNX IR tensor (``dtype`` for ml_dtypes arrays such as int4)."""
    return ir.Tensor(value, dtype=dtype)


def attach_weights(model: ir.Model, module: nn.Module, source: CheckpointWeights, owner: nn.Module) -> int:
    """Give every initializer of ``model`` traced from a parameter or a recipe its lazy value.

    ``module`` is the traced graph module (its parameter and buffer names are the initializer
    names); ``owner`` the model holding the parameters (whose parameter names are the
    checkpoint's keys). An initializer is either one of the module's recipes
    (``module.recipes``), or a parameter read from the checkpoint. Returns the number of lazy
    initializers.

    Raises (when the weights are written):
        WeightsError: a checkpoint without the tensor, or with another shape than the
            parameter's.
    """
    names = parameter_names(owner)
    params = dict(module.named_parameters(remove_duplicate=False))
    recipes = getattr(module, "recipes", {})

    def load(parameter: torch.Tensor) -> torch.Tensor:
        name = names.get(id(parameter))
        if name is None:
            raise WeightsError(f"a parameter of shape {list(parameter.shape)} is not part of the model")
        value = source.tensor(name)
        if tuple(value.shape) != tuple(parameter.shape):
            raise WeightsError(
                f"checkpoint tensor {name!r} has shape {list(value.shape)}, the model's config expects "
                f"{list(parameter.shape)}"
            )
        return value

    count = 0
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if name in recipes:
            recipe = recipes[name]
            key = ("recipe", name, str(tensor.dtype), tuple(tensor.shape))

            def compute(recipe=recipe):
                with torch.no_grad():
                    return torch_tensor(recipe(load))
        elif name in params:
            param = params[name]
            key = ("param", names.get(id(param)), str(tensor.dtype))

            def compute(param=param):
                return torch_tensor(load(param))
        else:
            continue  # a constant of the graph (rotary tables, shapes): its value is real
        value.const_value = SourcedTensor(compute, tensor.dtype, tensor.shape, key, name)
        count += 1
    return count


def fold_weight_transposes(model: ir.Model) -> int:
    """Replace each ``Transpose`` whose input is a lazy initializer used by it alone (an
    ``nn.Linear``'s ``MatMul(x, Transpose(W))``) by a lazy initializer holding the transposed
    weight, so constant folding never materializes a weight. Returns the number replaced."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        tensor = source.const_value if source is not None else None
        if not isinstance(tensor, SourcedTensor) or len(source.uses()) != 1 or not source.is_initializer():
            continue
        perm = node.attributes.get_ints("perm", None)
        perm = tuple(perm) if perm is not None else tuple(reversed(range(len(tensor.shape))))

        def transposed(tensor=tensor, perm=perm):
            return torch_tensor(tensor.compute().raw.permute(perm))

        shape = [tensor.shape[p] for p in perm]
        folded = ir.Value(name=f"{source.name}_t", shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype))
        folded.const_value = SourcedTensor(
            transposed, tensor.dtype, shape, (tensor.key, "transpose", perm), folded.name
        )
        node.outputs[0].replace_all_uses_with(folded, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.initializers.pop(source.name)
        graph.register_initializer(folded)
        count += 1
    return count
