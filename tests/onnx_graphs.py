"""Inspecting exported ONNX graphs in tests: nodes (subgraphs included), op counts,
symbolic dimensions."""

from __future__ import annotations

import onnx


def all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g)
            for g in attr.graphs:
                yield from all_nodes(g)


def symbolic_dims(model) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    found = []
    for info in [*g.input, *g.output, *g.value_info]:
        for d in info.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                found.append(f"{info.name}:{d.dim_param or '?'}")
    return found


def node_counts(model) -> dict[str, int]:
    """Nodes per op type, subgraphs (the Scan body) included."""
    counts: dict[str, int] = {}
    for node in all_nodes(model.graph):
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
