"""The house plan across all five packages: dependencies point one way (server -> engine ->
offload -> kvstore; kernels below the engine and the connector), no two modules import each
other (imports under ``TYPE_CHECKING`` included: a cycle hidden from the interpreter is still
one noun cut in two), no module imports another module's private names, and no file past the
line limit unless it is a named exception with a reason.
(`tests/kvstore/test_module_map.py` holds kvstore's own rules.)"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "offload", "engine", "kernels", "server")
# What each package may import of the others (kvstore: only its shared vocabulary and client).
ALLOWED = {
    "kvstore": {"kernels"},  # the daemon's copier launches the gather kernel
    "kernels": set(),
    "offload": {"kvstore", "kernels"},  # vLLM's device staging packs with copy_pieces
    "engine": {"offload", "kernels"},
    "server": {"engine", "offload", "kernels", "kvstore"},
}
# A size warning, not a cap: a file past it is either cut by meaning (one noun per file, never
# into files that import each other) or named below with the reason it is one noun.
LINE_LIMIT = 400
LARGER_FILES = {
    "kvstore/daemon/server.py": "the daemon's event loop, one noun: frames in, verbs out to "
                                "workers, replies back; the parts with state of their own "
                                "(acceptor, watch, limits, connection) already live apart",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _package_of(path: Path) -> list[str]:
    """The package that the relative imports of the module at ``path`` start from."""
    parts = next(n for n, p in MODULES.items() if p == path).split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(module, names, only for type checking) of every import in ``path``, relative ones made
    absolute. The tree's modules were read when this file was collected (``IMPORTS``)."""
    found = IMPORTS.get(path)
    return found if found is not None else _read_imports(path)


def _read_imports(path: Path) -> list[tuple[str, list[str], bool]]:
    # CPython 3.11's ast.parse can fail ("AST constructor recursion depth mismatch") beside
    # other threads of the same process: a worker that ran the cluster tests (UCX's threads)
    # failed here; at collection no test has started a thread yet.
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], id(node) in typing_only) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            module = node.module or ""
            if node.level:  # from the module's own package, one level up per extra dot
                package = _package_of(path)
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            found.append((module, [a.name for a in node.names], id(node) in typing_only))
    return found


IMPORTS = {path: _read_imports(path) for path in MODULES.values()}


def test_dependencies_point_one_way() -> None:
    bad = []
    for name, path in MODULES.items():
        own = name.split(".")[0]
        for module, _, _ in _imports(path):
            other = module.split(".")[0]
            if other in PACKAGES and other != own and other not in ALLOWED[own]:
                bad.append(f"{name} imports {module}")
    assert not bad, bad


def test_engine_and_offload_use_only_kvstores_shared_vocabulary_and_client() -> None:
    shared = {"kvstore", "kvstore.keys", "kvstore.layout", "kvstore.sizes"}
    bad = [f"{name} imports {module}" for name, path in MODULES.items()
           if name.split(".")[0] in ("offload", "engine")
           for module, _, _ in _imports(path)
           if module.split(".")[0] == "kvstore" and module not in shared]
    assert not bad, bad


def test_the_server_takes_no_part_of_the_daemons_command_line() -> None:
    """`kvengine`'s CLI shares argparse pieces with `kvstore`'s through `kvstore.cli.args` (the
    log line formats through `kvstore.log_lines`, the HTTP connection guard through
    `kvstore.http_guard`), never by importing the daemon's CLI modules."""
    shared = {"kvstore", "kvstore.keys", "kvstore.layout", "kvstore.sizes", "kvstore.cli.args",
              "kvstore.log_lines", "kvstore.process_guard",
              "kvstore.http_guard.connection_guard", "kvstore.rate_limited_log"}
    bad = [f"{name} imports {module}" for name, path in MODULES.items()
           if name.split(".")[0] == "server"
           for module, _, _ in _imports(path)
           if module.split(".")[0] == "kvstore" and module not in shared]
    assert not bad, bad


def test_no_module_imports_another_modules_private_names() -> None:
    bad = [f"{name} imports {module}.{n}" for name, path in MODULES.items()
           for module, names, _ in _imports(path) if module.split(".")[0] in PACKAGES
           and module != name for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def _import_graph() -> dict[str, dict[str, bool]]:
    """Each module's imports of the others: {imported: True when only under TYPE_CHECKING}."""
    def targets(module: str, names: list[str]) -> set[str]:
        # ``from kernels import rope`` depends on the submodule, not on the package's __init__
        subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
        return subs | ({module} if len(subs) < len(names) or not names else set())

    graph: dict[str, dict[str, bool]] = {}
    for name, path in MODULES.items():
        edges: dict[str, bool] = {}
        for module, names, typing_only in _imports(path):
            for target in targets(module, names):
                if target in MODULES and target != name:
                    edges[target] = edges.get(target, True) and typing_only
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, bool]]) -> list[str]:
    """One line per import cycle the depth-first walk meets, ``a -> b -(TYPE_CHECKING)-> a``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    found: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                found.append(loop[0] + "".join(
                    (" -(TYPE_CHECKING)-> " if graph[a][b] else " -> ") + b
                    for a, b in zip(loop, loop[1:])))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return found


def test_no_import_cycles_type_checking_imports_included() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import each other (put the behaviour with its noun):\n" + \
        "\n".join(cycles)


def _line_counts() -> dict[str, int]:
    paths = list(MODULES.values()) + sorted((ROOT / "benchmarks").glob("*.py"))
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in paths}


def _past_the_limit(counts: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """(files past ``LINE_LIMIT`` that are not named exceptions, warnings: the named ones past
    it, and named ones no longer past it, whose entry can go)."""
    unlisted = {f: n for f, n in counts.items() if n > LINE_LIMIT and f not in LARGER_FILES}
    notes = [f"{f}: {counts[f]} lines, past {LINE_LIMIT} ({why})" if counts.get(f, 0) > LINE_LIMIT
             else f"{f}: {counts.get(f, 0)} lines, no longer past {LINE_LIMIT}: drop it from "
                  "LARGER_FILES" for f, why in sorted(LARGER_FILES.items())]
    return unlisted, notes


def test_only_named_exceptions_pass_the_line_limit() -> None:
    unlisted, notes = _past_the_limit(_line_counts())
    for note in notes:
        warnings.warn(note, stacklevel=1)
    assert not unlisted, (f"past {LINE_LIMIT} lines: cut by meaning (never into files that "
                          f"import each other) or name it in LARGER_FILES with why: {unlisted}")


def test_the_checks_catch_what_they_look_for(tmp_path: Path, monkeypatch) -> None:
    """A cycle hidden under TYPE_CHECKING, one through a relative import, and a file past the
    limit each make their check fail; a named exception only warns."""
    planted = {"kvstore.fake_a": "from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from kvstore.fake_b import B\n",
               "kvstore.fake_b": "import kvstore.fake_a\n",
               "kvstore.fake_pkg": "from .c import C\n",
               "kvstore.fake_pkg.c": "from .. import fake_pkg\n"}
    for name, text in planted.items():
        path = tmp_path.joinpath(*name.split("."))
        path = path / "__init__.py" if name == "kvstore.fake_pkg" else path.with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        monkeypatch.setitem(MODULES, name, path)
    cycles = _cycles(_import_graph())
    assert "kvstore.fake_a -(TYPE_CHECKING)-> kvstore.fake_b -> kvstore.fake_a" in cycles
    assert "kvstore.fake_pkg -> kvstore.fake_pkg.c -> kvstore.fake_pkg" in cycles
    unlisted, _ = _past_the_limit({"kvstore/big.py": LINE_LIMIT + 1, "kvstore/ok.py": LINE_LIMIT})
    assert unlisted == {"kvstore/big.py": LINE_LIMIT + 1}
    monkeypatch.setitem(LARGER_FILES, "kvstore/big.py", "a planted exception")
    unlisted, notes = _past_the_limit({"kvstore/big.py": LINE_LIMIT + 1})
    assert not unlisted and any(n.startswith("kvstore/big.py") for n in notes)


@pytest.mark.parametrize("name", sorted(LARGER_FILES))
def test_named_exceptions_exist(name: str) -> None:
    assert (ROOT / name).is_file(), f"LARGER_FILES names {name}, which is not in the tree"
