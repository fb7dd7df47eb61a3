"""The package's shape: layers as folders, imports only downwards, no cycle, small files.

Walks every module of ``src/verispec`` with :mod:`ast` (imports inside functions included, since
they are how cycles hide) and checks the layout rules of the project:

- each top-level package or module belongs to one layer (:data:`LAYERS`, lowest first); a module
  may import its own layer and the layers below, never one above;
- the graph of module imports has no cycle (a package's ``__init__`` counts as a module);
- the package root is the public API's facade: it imports the base layer eagerly and everything
  else lazily, on first attribute access (:func:`test_the_public_api_loads_lazily`);
- at most :data:`MAX_TOP_MODULES` modules loose at the top; no Python file of the repository's
  code (:data:`PY_ROOTS`: the package, the tests, the scripts) over :data:`MAX_PY_LINES` lines
  (the tree is ``ruff format``-ted, so a file cannot meet the cap by packing lines), no C++ file
  of the package over :data:`MAX_CPP_LINES`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "verispec"
REPO = PACKAGE.parent.parent
PY_ROOTS = ("src", "tests", "scripts")  # every Python file of these folders counts

# Lowest first. A name is a top-level module or package of verispec.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "errors", "progress", "metrics", "output"),  # the base: imports nothing of ours above it
    ("algorithms",),  # pure algorithms: verify, trees, sampling, control formulas and schedules
    ("models",),  # store, registry, loading, GGUF reading
    ("runners",),  # model execution and the kernels
    ("proposers",),  # every drafter, behind one protocol
    ("engine",),  # the loop, request state, scheduler, policy, constraints, the loader
    ("bench", "training"),  # measuring and deciding (bench, advise, audit, export); training draft heads
    ("server",),  # the OpenAI app, worker, replicas
    ("cli",),  # one module per command
]
MAX_TOP_MODULES = 8
MAX_PY_LINES = 400
MAX_CPP_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, name: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` (its text ``source``) imports anywhere in its
    body, functions included: ``from a.b import c`` counts as ``a.b.c`` when that is a module,
    else ``a.b``."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return {m for m in found if m in known and m != name}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of LAYERS")


def without_type_checking(source: str) -> str:
    """``source`` without its ``if TYPE_CHECKING:`` blocks: the package root names its lazy exports
    there for type checkers only; at run time they load on first use (PEP 562 ``__getattr__``,
    after every module is imported), so they are no edge of the import graph. Only the root is
    read this way: anywhere else such an import would still be a dependency on the layer above."""
    tree = ast.parse(source)
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    ]
    return ast.unparse(tree)


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    graph = {}
    for p in paths:
        name, source = module_name(p), p.read_text()
        if name == "verispec":
            source = without_type_checking(source)
        graph[name] = imported_modules(source, name, known, p.name == "__init__.py")
    return graph


def test_the_public_api_loads_lazily():
    """``import verispec`` loads neither torch nor the engine; each name of ``__all__`` resolves;
    the names the root declares for type checkers are exactly its lazy exports."""
    probe = (
        "import sys, verispec\n"
        "print(sorted(m for m in sys.modules if m.startswith('verispec')), 'torch' in sys.modules)\n"
        "print(all(getattr(verispec, name) is not None for name in verispec.__all__))\n"
    )
    lines = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert lines == ["['verispec', 'verispec.errors'] False", "True"]
    import verispec

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    typed = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for node in block.body
        for alias in node.names
    }
    assert typed == verispec.LAZY_EXPORTS


def test_every_module_has_a_layer():
    for module in _graph():
        layer_of(module)


def test_imports_point_down_the_layers():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_no_import_cycle():
    assert find_cycle(_graph()) is None


def test_find_cycle_sees_a_cycle_hidden_in_a_function():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_and_relative_imports_are_seen():
    source = "def f():\n    from verispec.algorithms import verify\n    import verispec.engine\nfrom .b import x\n"
    known = {
        "verispec.algorithms",
        "verispec.algorithms.verify",
        "verispec.engine",
        "verispec.bench.b",
        "verispec.bench.a",
    }
    assert imported_modules(source, "verispec.bench.a", known) == {
        "verispec.algorithms.verify",
        "verispec.engine",
        "verispec.bench.b",
    }


def test_few_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_TOP_MODULES, loose


def test_no_python_file_too_long():
    files = [p for root in PY_ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 100  # the walk found the tree (a wrong REPO would pass on nothing)
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_PY_LINES}
    assert long == {}


@pytest.mark.parametrize("pattern", ["*.cpp", "*.h"])
def test_no_kernel_file_too_long(pattern):
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob(pattern)
        if (n := len(p.read_text().splitlines())) > MAX_CPP_LINES
    }
    assert long == {}


def test_the_engine_asks_runners_and_drafters_through_their_protocols():
    """No ``hasattr`` / ``getattr`` in ``engine/`` but on a tokenizer (a third party's object):
    every capability of a runner or drafter is declared with a default (``Runner``, ``Proposer``)."""
    looked_up = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("hasattr", "getattr"):
                subject = ast.unparse(node.args[0])
                if "tokenizer" not in subject:
                    looked_up.append(f"{path.name}:{node.lineno} {node.func.id}({subject}, ...)")
    assert looked_up == []
