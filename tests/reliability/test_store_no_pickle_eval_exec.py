"""No input is ever unpickled, evaluated or executed: an AST scan of every runtime package.

Flags: imports of pickle-like modules (pickle, dill, shelve, marshal...), calls of the builtins
eval/exec/compile/__import__, ``allow_pickle=True``, ``torch.load``, ``yaml.load``, jinja2
templates outside a sandboxed environment, ``shell=True`` / ``os.system``, and msgpack
``ext_hook``s other than one that rejects extension types. (A Redis client's
``.eval`` runs a constant Lua script inside Redis: an attribute call, not Python's eval.)
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvstore", "offload", "engine", "server", "kernels")
UNSAFE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve",
                            "marshal", "joblib", "jsonpickle"})
UNSAFE_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "execfile"})
JINJA_UNSANDBOXED = frozenset({"Environment", "Template", "NativeEnvironment"})


def _call_name(func: ast.expr) -> tuple[str | None, str | None]:
    """(base name, attribute) of a call target: ``eval`` -> (eval, None); ``a.b`` -> (a, b)."""
    if isinstance(func, ast.Name):
        return func.id, None
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else None
        return base, func.attr
    return None, None


def scan(source: str, filename: str = "<source>") -> list[str]:
    """Every unsafe construct in ``source``, as "file:line: what"."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            base, attr = _call_name(node.func)
            if attr is None and base in UNSAFE_BUILTINS:
                found.append(f"{where}: {base}()")
            if base == "builtins" and attr in UNSAFE_BUILTINS:
                found.append(f"{where}: builtins.{attr}()")
            if (base, attr) in {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"),
                                ("os", "system"), ("os", "popen")}:
                found.append(f"{where}: {base}.{attr}()")
            if (attr or base) in JINJA_UNSANDBOXED:
                found.append(f"{where}: jinja2 {attr or base}() outside a sandbox")
            for kw in node.keywords:
                if kw.arg in ("allow_pickle", "shell") and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    found.append(f"{where}: {kw.arg}={ast.unparse(kw.value)}")
                # msgpack extension types decoded into objects: only a hook that rejects them
                if kw.arg == "ext_hook" and not (
                        isinstance(kw.value, ast.Name) and "reject" in kw.value.id):
                    found.append(f"{where}: msgpack ext_hook={ast.unparse(kw.value)}")
    return found


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py"))


def test_the_scanner_finds_every_kind_of_construct() -> None:
    bad = '''
import pickle
import dill as d
from marshal import loads
def f(x, y):
    eval(x)
    exec(y)
    compile(x, "f", "exec")
    __import__(x)
    builtins.eval(x)
    np.load(x, allow_pickle=True)
    torch.load(x)
    yaml.load(x)
    subprocess.run(x, shell=True)
    msgpack.unpackb(x, ext_hook=decode_ext)
    os.system(x)
    jinja2.Environment().from_string(x)
    Template(x)
'''
    found = scan(bad)
    assert len(found) == 16, found
    fine = '''
import re, json, msgpack
from jinja2.sandbox import ImmutableSandboxedEnvironment
def f(redis, x):
    re.compile(x)
    redis.eval("return 1", 0)
    json.loads(x)
    np.load(x, allow_pickle=False)
    ImmutableSandboxedEnvironment().from_string(x)
    subprocess.run(["ls"], shell=False)
    msgpack.unpackb(x, ext_hook=reject_ext)
'''
    assert scan(fine) == []


def test_runtime_packages_never_unpickle_eval_or_exec() -> None:
    files = _sources()
    assert len(files) > 50 and {p.relative_to(REPO_ROOT).parts[0] for p in files} == \
        set(PACKAGES)
    found = [hit for path in files
             for hit in scan(path.read_text(), str(path.relative_to(REPO_ROOT)))]
    assert found == []

