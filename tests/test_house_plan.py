"""The house plan across all five packages: dependencies point one way (server -> engine ->
offload -> kvstore; kernels below the engine), no import cycles, no module imports another
module's private names, no file over 400 lines. (`tests/kvstore/test_module_map.py` holds
kvstore's own finer rules.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "offload", "engine", "kernels", "server")
# What each package may import of the others (kvstore: only its shared vocabulary and client).
ALLOWED = {
    "kvstore": {"kernels"},  # the daemon's copier launches the gather kernel
    "kernels": set(),
    "offload": {"kvstore"},
    "engine": {"offload", "kernels"},
    "server": {"engine", "offload", "kernels", "kvstore"},
}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(module, names, only for type checking) of every absolute import in ``path``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], id(node) in typing_only) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [a.name for a in node.names], id(node) in typing_only))
    return found


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
    """`kvengine`'s CLI shares argparse pieces with `kvstore`'s through `kvstore.cli_args`, never
    by importing the daemon's CLI modules."""
    shared = {"kvstore", "kvstore.keys", "kvstore.layout", "kvstore.sizes", "kvstore.cli_args"}
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


def test_no_import_cycles() -> None:
    def targets(module: str, names: list[str]) -> set[str]:
        # ``from kernels import rope`` depends on the submodule, not on the package's __init__
        subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
        return subs | ({module} if len(subs) < len(names) or not names else set())

    graph = {name: {t for m, names, typing_only in _imports(path) if not typing_only
                    for t in targets(m, names) if t in MODULES and t != name}
             for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError(" -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, stack + [node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_every_file_is_under_the_line_limit() -> None:
    paths = list(MODULES.values()) + sorted((ROOT / "benchmarks").glob("*.py"))
    too_long = {str(p.relative_to(ROOT)): n for p in paths
                if (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert not too_long, too_long
