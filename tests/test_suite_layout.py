"""The test suite's own layout (issue 56): folders that mirror the package, no test module importing
another, and a ``conftest.py`` only where test modules share fixtures.

Walks every Python file of ``tests/`` with :mod:`ast` (imports inside functions included), as
``test_layers.py`` walks the package:

- each folder of ``tests/`` that holds test modules mirrors a folder of the package
  (``tests/runners/cpu/`` for ``src/verispec/runners/cpu/``), and no two test modules share a base
  name (pytest imports them by it: the folders have no ``__init__.py``);
- no Python file of ``tests/`` imports a test module: what test modules share is a fixture of a
  ``conftest.py`` or a helper of a support module (``helpers``, ``gguf_models``,
  ``batching_support``, ...);
- each fixture of a ``conftest.py`` is taken by at least two test modules (or used by all, being
  autouse), and sits in the ``conftest.py`` of the lowest folder that holds them all
  (``tests/conftest.py`` for the fixtures of several folders).
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "src" / "verispec"


def suite_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def imported_test_modules(source: str, test_names: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` for each import of a module named in ``test_names`` in ``source``,
    functions included: ``import test_a``, ``from test_a import x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules = [node.module]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m.split(".")[0] in test_names]
    return found


def is_fixture(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(node, ast.Attribute) and node.attr == "fixture") or (
        isinstance(node, ast.Name) and node.id == "fixture"
    )


def fixture_defs(tree: ast.AST) -> dict[str, bool]:
    """The fixtures a module or conftest defines: name -> autouse."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                if is_fixture(decorator):
                    autouse = isinstance(decorator, ast.Call) and any(
                        k.arg == "autouse" and getattr(k.value, "value", False) is True for k in decorator.keywords
                    )
                    found[node.name] = autouse
    return found


def parametrized_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
            argnames = decorator.args[0] if decorator.args else next(k.value for k in decorator.keywords)
            if isinstance(argnames, ast.Constant):
                names.update(n.strip() for n in argnames.value.split(","))
            elif isinstance(argnames, (ast.List, ast.Tuple)):
                names.update(e.value for e in argnames.elts if isinstance(e, ast.Constant))
    return names


def fixtures_taken(tree: ast.AST) -> set[str]:
    """The fixtures a test module takes from a conftest: the arguments of its tests and fixtures
    (less parametrized ones) and its ``usefixtures`` names, less what it defines or imports."""
    taken: set[str] = set()
    own: set[str] = set(fixture_defs(tree))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("test") or any(is_fixture(d) for d in node.decorator_list):
                taken.update({a.arg for a in node.args.args + node.args.kwonlyargs} - parametrized_names(node))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "usefixtures":
            taken.update(a.value for a in node.args if isinstance(a, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            own.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return taken - own


def test_the_test_folders_mirror_the_package_and_base_names_are_unique():
    modules = suite_modules()
    assert len(modules) > 100  # the walk found the suite
    folders = {p.parent for p in modules} - {TESTS}
    assert sorted(str(f.relative_to(TESTS)) for f in folders if not (PACKAGE / f.relative_to(TESTS)).is_dir()) == []
    assert [name for name, n in Counter(p.name for p in modules).items() if n > 1] == []
    assert sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py")) == []


def test_no_test_module_imports_another():
    names = {p.stem for p in suite_modules()}
    imports = [
        f"{path.relative_to(TESTS)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imported_test_modules(path.read_text(), names)
    ]
    assert imports == []


def test_the_import_scan_sees_imports_inside_functions():
    source = "import test_a\nfrom helpers import test_b\ndef f():\n    from test_c.x import y\n    import os\n"
    assert imported_test_modules(source, {"test_a", "test_b", "test_c"}) == [(1, "test_a"), (4, "test_c.x")]


def test_every_conftest_fixture_is_shared_by_the_modules_below_it():
    taken = {p: fixtures_taken(ast.parse(p.read_text())) for p in suite_modules()}
    conftests = {p.parent: fixture_defs(ast.parse(p.read_text())) for p in sorted(TESTS.rglob("conftest.py"))}
    assert TESTS in conftests and len(conftests) > 1
    wrong = []
    for folder, fixtures in conftests.items():
        for name, autouse in fixtures.items():
            users = [
                module
                for module, names in taken.items()
                if name in names
                # this conftest is the nearest one above the module that defines the name
                and next((f for f in [module.parent, *module.parent.parents] if name in conftests.get(f, {})), None)
                == folder
            ]
            where = folder.relative_to(TESTS.parent) / "conftest.py"
            if autouse:  # used by every module below it
                continue
            if len(users) < 2:
                wrong.append(f"{where}: {name} is taken by {[m.name for m in users]}, not shared")
            elif (lowest := Path(os.path.commonpath([m.parent for m in users]))) != folder:
                wrong.append(f"{where}: {name} belongs in {lowest.relative_to(TESTS.parent)}/conftest.py")
    assert wrong == []


def test_the_fixture_scan_leaves_out_parametrized_defined_and_imported_names():
    source = (
        "import pytest\nfrom helpers import single_thread\n"
        "@pytest.fixture\ndef own(target):\n    return target\n"
        "pytestmark = pytest.mark.usefixtures('home')\n"
        "@pytest.mark.parametrize('files, k', [(1, 2)])\n"
        "def test_a(own, files, k, gguf_files, single_thread):\n    pass\n"
        "def test_b(files):\n    pass\n"
    )
    assert fixtures_taken(ast.parse(source)) == {"target", "home", "gguf_files", "files"}  # test_b takes files
