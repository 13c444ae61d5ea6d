"""vLLM's entry into kvstore-tiered (entry point ``vllm.general_plugins``): registers
``KVStoreConnector`` by name, so ``{"kv_connector": "KVStoreConnector"}`` needs no module path.

Why this file is a top-level module named after the distribution, and why it binds packages:
``kvstore`` and ``offload`` are generic names. A folder of that name in the working directory
(``/tmp/kvstore`` holding the daemon's socket, a project's own ``offload/``) is found before the
installed package whenever the working directory is on ``sys.path`` (``python -m vllm...``, and
vLLM's workers inherit that path); an editable install's finder even runs after every such
folder. Raising an error naming the folder would leave the user to move their files; instead
vLLM's processes import ``kvstore`` and ``offload`` from the folder this module was installed
beside (site-packages, or the checkout of an editable install), before anything else imports
them: every submodule then comes from the package's own ``__path__``, never from ``sys.path``.
The shadowing folder is named in a log line. Only a different ``kvstore``/``offload`` imported
before vLLM loaded this plugin is an error (a process cannot hold two modules of one name), and
only for a user of the connector: the plugin runs in every vLLM process of the environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from typing import Any

CONNECTOR_NAME = "KVStoreConnector"
PACKAGES = ("kvstore", "offload")
_ROOT = Path(__file__).resolve().parent  # where the distribution's packages were installed

log = logging.getLogger("offload.vllm")


def _origin(spec: ModuleSpec | None) -> str | None:
    if spec is None or spec.origin in (None, "namespace"):
        return None
    return str(Path(spec.origin).resolve())


def _folder(spec: ModuleSpec | None) -> str:
    """Where a spec would import a package from, for a message."""
    if spec is None:
        return "nowhere"
    if spec.submodule_search_locations:
        return ", ".join(dict.fromkeys(str(p) for p in spec.submodule_search_locations))
    return str(spec.origin)


def bind_packages() -> None:
    """Import ``kvstore`` and ``offload`` from this distribution (idempotent). Raises
    ``ImportError`` naming both folders when another module of one of those names is loaded."""
    for name in PACKAGES:
        ours = PathFinder.find_spec(name, [str(_ROOT)])
        if ours is None or ours.loader is None or _origin(ours) is None:
            raise ImportError(f"kvstore-tiered: no {name} package beside {__file__}")
        loaded = sys.modules.get(name)
        if loaded is not None:
            if _origin(getattr(loaded, "__spec__", None)) == _origin(ours):
                continue
            raise ImportError(
                f"kvstore-tiered: a module named {name!r} from "
                f"{_folder(getattr(loaded, '__spec__', None))} was imported before vLLM loaded "
                f"the kvstore plugin, so the connector cannot use its own {name} package "
                f"({Path(_folder(ours))}). Rename or move that folder, or start vLLM from "
                f"another directory.")
        plain = importlib.util.find_spec(name)  # what ``import name`` would take
        if _origin(plain) != _origin(ours):
            level = logging.WARNING if _origin(plain) is not None else logging.INFO
            log.log(level, "kvstore plugin: 'import %s' would take %s; vLLM's processes use "
                    "kvstore-tiered's %s instead", name, _folder(plain), _folder(ours))
        module = importlib.util.module_from_spec(ours)
        sys.modules[name] = module
        try:
            ours.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise


def register() -> None:
    """The ``vllm.general_plugins`` hook (run once in each vLLM process, before any connector is
    made): binds the packages and registers the connector by name. Never raises for a process
    that may not use the connector; a binding problem is raised when the class is asked for."""
    try:
        bind_packages()
    except ImportError as exc:
        log.warning("%s", exc)
    _log_like_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # registered already: a second call in one process
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)


def _log_like_vllm() -> None:
    """The connector's lines ("offload" loggers: connected to kvstore at ..., its layout, its
    warnings) go where vLLM's go, in vLLM's format and at its level (VLLM_LOGGING_LEVEL)."""
    vllm_log, ours = logging.getLogger("vllm"), logging.getLogger("offload")
    if not vllm_log.handlers or ours.handlers:
        return  # vLLM's logging is off (VLLM_CONFIGURE_LOGGING=0), or ours is set up already
    for handler in vllm_log.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_log.level or logging.INFO)
    ours.propagate = False


def __getattr__(name: str) -> Any:
    """``KVStoreConnector``, loaded lazily: what vLLM's factory asks this module for."""
    if name != CONNECTOR_NAME:
        raise AttributeError(name)
    bind_packages()
    from offload.vllm.config_check import check_requested_config
    from offload.vllm.connector import KVStoreConnector

    check_requested_config(name)  # vLLM's config creation: bad settings fail here, in one line
    return KVStoreConnector
