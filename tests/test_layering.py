"""The import graph of breakgraph/: no circles (function-local imports count; imports for type
checking only do not) and no import from a lower layer to a higher one. The layers, bottom to
top, are docs/design.md's: a module may import its own layer and the ones below."""

from __future__ import annotations

import ast
from pathlib import Path

import breakgraph

ROOT = Path(breakgraph.__file__).parent
LAYERS = [
    {"common", "tokenizer"},
    {"kernels", "graph"},
    {"distributed"},
    {"forward_batch"},
    {"cache"},
    {"layers"},
    {"models"},
    {"engine"},
    {"server"},
    {"bench"},
    {"cli", "docgen", "__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("breakgraph", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    lines.add(getattr(inner, "lineno", -1))
    return lines


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    deps.add(target if target in mods else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        edges[name] = {d for d in deps if d in mods and d != name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_circles():
    assert _cycles(import_graph()) == []


def test_imports_point_down_the_layers():
    upward = []
    for module, deps in import_graph().items():
        if module == "breakgraph":
            continue
        for dep in deps:
            if dep != "breakgraph" and RANK[_layer(dep)] > RANK[_layer(module)]:
                upward.append(f"{module} -> {dep}")
    assert upward == []


def test_graph_knows_nothing_of_llms():
    """graph/ is usable on any PyTorch callable: it imports breakgraph.common at most."""
    for module, deps in import_graph().items():
        if _layer(module) == "graph":
            assert all(_layer(d) in ("graph", "common") for d in deps), (module, deps)


def test_every_top_level_module_has_a_layer():
    assert {_layer(m) for m in import_graph() if m != "breakgraph"} <= set(RANK)
