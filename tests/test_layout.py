"""The package's layout (docs/design.md): imports point one way, no module imports another in a loop,
each runtime's code lives in its own folder and the backends never import each other. Read from the
sources' import statements (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import qwen35_onnx

PACKAGE = Path(next(iter(qwen35_onnx.__path__)))

#: Layers from the top; a module may import its own layer or any below it, never one above.
LAYERS = (
    {"cli"},
    {"cluster"},
    {"server", "bench", "demo", "verify", "chat_repl"},
    {"pipeline", "group", "streams"},
    {"conversation", "runtime"},
    {"onnxfile", "export", "checkpoints"},
    {"contract", "image_grids", "options", "presets", "paths", "interrupts", "host_memory"},
)


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (relative imports resolved; ``from . import x`` of a
    module counts as that module)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                candidates = [target] + [f"{target}.{a.name}" if target else a.name for a in node.names]
                found.update(c for c in candidates if c in modules)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for full in names:
                    if full.startswith("qwen35_onnx."):
                        found.update(m for m in (full[len("qwen35_onnx.") :],) if m in modules)
        graph[name] = found - {name, ""}  # "": the package's face (its version), imported from anywhere
    return {name: targets for name, targets in graph.items() if name}


def _top(module: str) -> str:
    return module.split(".")[0]


def test_no_import_loop():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import loop: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_imports_point_down():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = _imports()
    assert {_top(m) for m in graph if m} <= set(layer), "a new top-level module: place it in LAYERS"
    upward = [(a, b) for a, targets in graph.items() if a for b in targets if layer[_top(b)] < layer[_top(a)]]
    assert not upward, upward


def test_each_runtime_in_its_own_folder_and_the_backends_apart():
    graph = _imports()
    for name in ("runtime.onnxruntime", "runtime.openvino"):
        other = "runtime.openvino" if name == "runtime.onnxruntime" else "runtime.onnxruntime"
        inside = [m for m in graph if m.startswith(name)]
        assert inside and not [m for m in inside for t in graph[m] if t.startswith(other)], name
    # only select.py picks a backend; the shared runtime modules import neither
    shared = [m for m in graph if m.startswith("runtime.") and m.count(".") == 1 and m != "runtime.select"]
    assert not [(m, t) for m in shared for t in graph[m] if t.startswith(("runtime.onnxruntime", "runtime.openvino"))]
    # the conversation layer and the runtime do not know each other
    for a, b in (("conversation", "runtime"), ("runtime", "conversation")):
        assert not [m for m in graph if _top(m) == a for t in graph[m] if _top(t) == b], (a, b)
