"""The package's shape holds: no import cycles, no module importing another's private names,
every file under 400 lines, every module importable without CuPy, every verb in the table."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "kvstore"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every run-time import in ``path``; imports
    under ``if TYPE_CHECKING:`` are left out (they never run)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If)
            and _is_type_checking(stmt.test) for body in stmt.body for node in ast.walk(body)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            found += [(m, []) for m in submodules]
            found.append((node.module, [n for n in names
                                        if f"{node.module}.{n}" not in MODULES]))
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in _imports(path) if m in MODULES and m != name}
            for name, path in MODULES.items()}


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names() -> None:
    bad = [f"{name} imports {module}.{n}" for name, path in MODULES.items()
           for module, names in _imports(path) if module.startswith("kvstore")
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def test_every_file_is_under_the_line_limit() -> None:
    too_long = {name: n for name, path in MODULES.items()
                if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not too_long, too_long


def test_every_module_imports_without_cupy() -> None:
    code = ("import importlib, sys\n"
            "sys.modules['cupy'] = None  # any import of it now raises ImportError\n"
            f"for name in {sorted(MODULES)!r}:\n"
            "    importlib.import_module(name)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=PACKAGE_DIR.parent)


def test_the_verb_table_has_every_protocol_verb() -> None:
    from kvstore.daemon.service import Service
    from kvstore.store.config import StoreConfig
    from kvstore.store.tiered import TieredStore
    from kvstore.wire.protocol import SCHEMAS

    with TieredStore(StoreConfig(dram_bytes=1 << 20, pin_memory=False)) as store:
        service = Service(store)
        try:
            assert set(service.verbs) == set(SCHEMAS)
        finally:
            service.close()


@pytest.mark.parametrize("check", [test_no_import_cycles,
                                   test_no_module_imports_another_modules_private_names])
def test_the_checks_catch_what_they_look_for(check, tmp_path, monkeypatch) -> None:
    """A planted cycle and a planted private import each make their check fail."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from kvstore.fake_b import _hidden\n")
    b.write_text("import kvstore.fake_a\n")
    monkeypatch.setitem(MODULES, "kvstore.fake_a", a)
    monkeypatch.setitem(MODULES, "kvstore.fake_b", b)
    with pytest.raises(AssertionError):
        check()
