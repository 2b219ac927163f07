"""The package's imports run one way: no module imports, directly or through others, a module that imports it,
and no package imports one of a higher layer (DESIGN.md, Imports).

The graph is read from the source with `ast`, so every import counts: at the top of a file, inside a function,
under `if TYPE_CHECKING`, relative or absolute. `from vitscope.data import load_dataset` is an edge to the
package `vitscope.data` (its __init__ runs); `from vitscope.data import base` is an edge to the module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vitscope

PACKAGE = Path(vitscope.__file__).resolve().parent

# DESIGN.md's layers, highest first: cli -> training -> tasks (caption, translate) -> the sequence package ->
# weights / models -> kernels, inspect -> the model files -> their parts (attention, positional, conv_stem,
# residual) and data; `errors`, `fields`, `io`,
# `figures` and `param_groups` serve every layer. A package may import its own layer or lower ones.
LAYERS = [
    {"__main__", "console"},
    {"cli"},
    {"training"},
    {"caption", "translate"},
    {"sequence"},
    {"", "models", "weights"},  # "": the package's own __init__, the public names over models
    {"kernels", "inspect"},
    {"vit", "decoder"},
    {"attention", "positional", "data", "conv_stem", "residual"},
    {"errors", "fields", "io", "figures", "param_groups"},
]


def module_files() -> dict[str, tuple[Path, bool]]:
    """Every module's dotted name -> (its file, whether it is a package's __init__)."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = ["vitscope", *f.relative_to(PACKAGE).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (f, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the vitscope modules it imports anywhere in its file."""
    modules = module_files()

    def known(name: str) -> str:  # `import vitscope.a.b.Name`-like dotted paths end at the module
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {known(a.name) for a in node.names if a.name.split(".")[0] == "vitscope"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "vitscope":
                    continue
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    edges.add(sub if sub in modules else known(source))
        edges.discard(name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as one circle through its members,
    e.g. ['a', 'b', 'a']."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_circle(graph, g) for g in groups]


def _one_circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {w: [start, w] for w in sorted(graph[start] & group)}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return paths[start]


def test_the_graph_sees_every_kind_of_import():
    """A check that reads nothing passes anything: the graph holds imports of each kind known to be in the code."""
    graph = import_graph()
    assert len(graph) > 60  # every module, packages and their __init__ included
    assert "vitscope.cli.common" in graph["vitscope.cli.main"]  # top level, a submodule's name
    assert "vitscope.data.image_files" in graph["vitscope.cli.predict"]  # inside a function
    assert "vitscope.data" in graph["vitscope.cli.data"]  # `from vitscope.data import ...`: the package


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_package_imports_a_higher_layer():
    rank = {part: i for i, layer in enumerate(LAYERS) for part in layer}

    def part(module: str) -> str:
        return module.split(".")[1] if "." in module else ""

    graph = import_graph()
    unplaced = sorted({part(m) for m in graph} - set(rank))
    assert not unplaced, f"put {unplaced} in a layer of LAYERS"
    upward = [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
              if rank[part(t)] < rank[part(m)]]
    assert not upward, "imports of a higher layer: " + "; ".join(upward)


def test_tasks_never_import_each_other():
    """What captioning and translation share lives in vitscope.sequence, below both (STYLE 18)."""
    graph = import_graph()
    tasks = ("vitscope.caption", "vitscope.translate")

    def task(module: str) -> str | None:
        return next((t for t in tasks if module == t or module.startswith(t + ".")), None)

    crossing = [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
                if task(m) and task(t) and task(m) != task(t)]
    assert not crossing, "tasks importing each other: " + "; ".join(crossing)


# Imports of vitscope modules inside functions, outside cli/ (whose sub-commands import what they run, so
# `vitscope --help` stays quick): imports stand at the top of a module, where the graph can be read.
MAX_IMPORTS_IN_FUNCTIONS = 15


def test_imports_stand_at_the_top():
    inner = []
    for name, (path, _) in module_files().items():
        if name.startswith("vitscope.cli") or name == "vitscope.console":
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner += [f"{name}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)
                          and (n.module or "").startswith("vitscope") or isinstance(n, ast.Import)
                          and any(a.name.startswith("vitscope") for a in n.names)]
    assert len(inner) <= MAX_IMPORTS_IN_FUNCTIONS, (
        f"{len(inner)} imports of vitscope modules inside functions outside cli/: " + ", ".join(inner))
