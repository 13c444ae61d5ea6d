"""kvstore's own rules: every module imports without CuPy or NVIDIA's cuda-bindings (the CPU
daemon never needs them), and the verb table names exactly the protocol's verbs. Cycles
(``TYPE_CHECKING`` imports included), private imports and file sizes are checked over all five
packages by ``tests/test_house_plan.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "kvstore"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def test_every_module_imports_without_cupy_or_cuda_bindings() -> None:
    code = ("import importlib, sys\n"
            "sys.modules['cupy'] = None  # any import of it now raises ImportError\n"
            "sys.modules['cuda'] = None  # cuda.bindings too\n"
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
