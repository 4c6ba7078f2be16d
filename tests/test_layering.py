"""The package's import layering, read from the source with ``ast`` (nothing is imported).

Every ``import`` / ``from ... import`` under ``pagedllm/`` counts, at any depth
(function-level lazy imports included), plus ``importlib.import_module`` with
a literal name. An import is *module-level* when it runs on import of the
module: not inside a function or class body, nor under ``if TYPE_CHECKING:``.
Parent packages that Python runs implicitly (``pagedllm/__init__.py`` for
``import pagedllm.core.x``) are not edges; an explicit ``from pagedllm import X``
is one.

Run as a script, ``python tests/test_layering.py [ROOT]`` prints the cycle and
upward-import counts of the tree at ROOT (default: this checkout).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# rooms the core (scheduler, KV cache) must not reach into
CORE_FORBIDDEN = ("pagedllm.worker", "pagedllm.models", "pagedllm.engine", "pagedllm.server")


@dataclass(frozen=True)
class Edge:
    """One import of a pagedllm module by another."""

    src: str
    dst: str
    line: int
    module_level: bool


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(body: list[ast.stmt], out: set[int]) -> None:
    """Collect ids of statements run on import: descend into if/try/with/for, not def/class."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            _runtime_nodes(node.orelse, out)
            continue
        out.add(id(node))
        for name in ("body", "orelse", "finalbody"):
            _runtime_nodes(getattr(node, name, None) or [], out)
        for handler in getattr(node, "handlers", None) or []:
            _runtime_nodes(handler.body, out)
        # a module-level importlib.import_module("...") is a call in this statement's own
        # expressions (not in a nested def or lambda, which run later)
        todo = [c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.expr, ast.withitem))]
        while todo:
            child = todo.pop()
            if isinstance(child, ast.Lambda):
                continue
            if isinstance(child, ast.Call):
                out.add(id(child))
            todo.extend(ast.iter_child_nodes(child))


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import node may load (``from a import b`` gives ``a`` and ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: climb from this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def import_graph(root: Path = ROOT) -> tuple[set[str], list[Edge]]:
    """Return the pagedllm modules under ``root`` and every import edge between them.

    Raises ``SyntaxError`` for a module that does not parse.
    """
    paths = {_module_name(root, p): p for p in sorted((root / "pagedllm").rglob("*.py"))}

    def owner(name: str) -> str | None:
        # the longest known module that prefixes name (``pagedllm.models.loader.X`` -> the loader)
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        runtime: set[int] = set()
        _runtime_nodes(tree.body, runtime)
        for node in ast.walk(tree):
            names = _imported_names(node, module, path.name == "__init__.py")
            # one edge per imported module and statement (``from a.b import X`` names a.b twice)
            dsts = {owner(n) for n in names if n.split(".")[0] == "pagedllm"} - {None, module}
            edges += [Edge(module, d, getattr(node, "lineno", 0), id(node) in runtime) for d in sorted(dsts)]
    return set(paths), edges


def _adjacency(modules: set[str], edges: list[Edge], module_level_only: bool) -> dict[str, set[str]]:
    adj: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.module_level or not module_level_only:
            adj[e.src].add(e.dst)
    return adj


def elementary_cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """Every simple cycle of ``adj``, each listed once starting from its smallest module name."""
    order = {m: i for i, m in enumerate(sorted(adj))}
    cycles = []
    for start in sorted(adj):
        # only paths through modules after ``start`` in order: each cycle is found from its smallest node
        path, on_path = [start], {start}
        stack = [iter(sorted(adj[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                on_path.discard(path.pop())
            elif nxt == start:
                cycles.append(list(path))
            elif order[nxt] > order[start] and nxt not in on_path:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(adj[nxt])))
    return cycles


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _edges(edges: list[Edge], src: str, dst: str) -> list[Edge]:
    return [e for e in edges if _under(e.src, src) and _under(e.dst, dst)]


def upward_core_imports(edges: list[Edge]) -> list[Edge]:
    """Imports, at any depth, from ``pagedllm.core`` into a room above it (``CORE_FORBIDDEN``)."""
    return [e for room in CORE_FORBIDDEN for e in _edges(edges, "pagedllm.core", room)]


@pytest.fixture(scope="module")
def graph() -> tuple[set[str], list[Edge]]:
    """This checkout's modules and import edges, parsed once for the module."""
    return import_graph()


def _show(edges: list[Edge]) -> str:
    return "; ".join(f"{e.src} -> {e.dst} (line {e.line})" for e in edges)


def floors(design: Path = ROOT / "docs/design.md") -> dict[str, int]:
    """Room name -> floor number, read from the ordered list between ``<!-- layering -->`` and
    ``<!-- /layering -->`` in ``docs/design.md`` (each item's backquoted names are one floor)."""
    text = design.read_text()
    block = text.split("<!-- layering -->", 1)[1].split("<!-- /layering -->", 1)[0]
    out: dict[str, int] = {}
    for line in block.strip().splitlines():
        number, _, rest = line.partition(". ")
        names = rest.split(":", 1)[0]
        for name in names.replace("`", "").split(","):
            out[name.strip()] = int(number)
    return out


def room_of(module: str, modules: set[str]) -> str:
    """The room a module lives in: its folder under ``pagedllm/``, or its own name for a top-level
    module (``__init__`` for the package itself)."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def upward_imports(modules: set[str], edges: list[Edge], floor: dict[str, int]) -> list[Edge]:
    """Imports, at any depth, from a room into one on a higher floor."""
    return [e for e in edges
            if floor[room_of(e.dst, modules)] > floor[room_of(e.src, modules)]]


def test_every_room_is_on_a_floor(graph):
    modules, _ = graph
    floor = floors()
    missing = sorted({room_of(m, modules) for m in modules} - set(floor))
    assert not missing, f"rooms not placed in docs/design.md's layering: {missing}"


def test_no_room_imports_from_a_higher_floor(graph):
    modules, edges = graph
    bad = upward_imports(modules, edges, floors())
    assert not bad, f"imports that run up the floors of docs/design.md: {_show(bad)}"


def test_no_import_cycle_at_any_depth(graph):
    modules, edges = graph
    cycles = elementary_cycles(_adjacency(modules, edges, module_level_only=False))
    assert not cycles, "import cycles (lazy imports included): " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_the_graph_sees_lazy_imports(graph):
    # guards against a parser that silently finds nothing: cli dispatches to the benchmarks lazily
    _, edges = graph
    lazy = [e for e in _edges(edges, "pagedllm.cli", "pagedllm.bench.offline") if not e.module_level]
    assert lazy, "expected cli.py's function-level import of bench.offline"


def test_core_imports_no_upper_room(graph):
    _, edges = graph
    bad = upward_core_imports(edges)
    assert not bad, f"core/ imports a room above it: {_show(bad)}"


def test_no_module_level_import_cycle(graph):
    modules, edges = graph
    cycles = elementary_cycles(_adjacency(modules, edges, module_level_only=True))
    assert not cycles, "module-level import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


@pytest.mark.parametrize("src,dst", [
    ("pagedllm.core.scheduler_output", "pagedllm.worker"),
    ("pagedllm.kernels", "pagedllm.models"),
    ("pagedllm.bench.offline", "pagedllm.cli"),
    ("pagedllm.cli_args", "pagedllm.cli"),
    ("pagedllm.cli_args", "pagedllm.bench"),
    ("pagedllm.models.loader", "pagedllm.models.real_models"),
    ("pagedllm.models.loader", "pagedllm.models.resolve"),
    ("pagedllm.models.real_models", "pagedllm.models.resolve"),
])
def test_no_import_at_any_depth(graph, src, dst):
    _, edges = graph
    bad = _edges(edges, src, dst)
    assert not bad, f"{src} must not import {dst}: {_show(bad)}"


@pytest.mark.parametrize("a,b", [
    ("pagedllm.cli", "pagedllm.bench.offline"),
    ("pagedllm.models.loader", "pagedllm.models.real_models"),
])
def test_pair_does_not_import_each_other(graph, a, b):
    _, edges = graph
    assert not (_edges(edges, a, b) and _edges(edges, b, a)), \
        f"{a} and {b} import each other: {_show(_edges(edges, a, b) + _edges(edges, b, a))}"


def test_cache_imports_only_envs(graph):
    # floor one: the cache directory needs nothing of the package but the environment's reader
    _, edges = graph
    bad = [e for e in _edges(edges, "pagedllm.cache", "pagedllm") if e.dst != "pagedllm.envs"]
    assert not bad, f"pagedllm.cache must import only pagedllm.envs: {_show(bad)}"


def test_only_envs_reads_the_environment():
    # every environment variable is read (and documented) in pagedllm/envs.py
    readers = []
    for path in sorted((ROOT / "pagedllm").rglob("*.py")):
        if path.name == "envs.py" and path.parent.name == "pagedllm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, f"os.environ outside pagedllm/envs.py: {readers}"


def test_real_models_uses_no_private_loader_names():
    tree = ast.parse((ROOT / "pagedllm/models/real_models.py").read_text())
    private = [n.attr for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "loader"
               and n.attr.startswith("_")]
    private += [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "pagedllm.models.loader"
                for a in n.names if a.name.startswith("_")]
    assert not private, f"real_models uses private loader names: {private}"


def _report(root: Path) -> None:
    modules, edges = import_graph(root)
    for label, only_top in (("module-level", True), ("any depth (lazy included)", False)):
        cycles = elementary_cycles(_adjacency(modules, edges, only_top))
        print(f"import cycles, {label}: {len(cycles)}")
        for c in cycles:
            print("   " + " -> ".join(c + c[:1]))
    up = upward_core_imports(edges)
    print(f"upward imports core -> worker/models/engine/server: {len(up)}")
    for e in up:
        print(f"   {e.src} -> {e.dst} (line {e.line})")


if __name__ == "__main__":
    _report(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
