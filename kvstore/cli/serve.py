"""``kvstore serve``: the daemon's flags, and the daemon started from them.

User errors (a bad flag, an unparsable SIZE, an unusable --ssd-dir, a busy socket or port) end
with one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.cli.args import (
    EXIT_FAILURE,
    add_config_option,
    package_version,
    positive_float_arg,
    positive_int_arg,
    size_arg,
)
from kvstore.cli.banner import describe_cluster, describe_start
from kvstore.cli.copies import add_copy_flags, copy_settings_from_args
from kvstore.cli.limits import add_limit_flags, limits_from_args
from kvstore.log_lines import LOG_FORMATS, configure
from kvstore.process_guard import forbid_inspection
from kvstore.sizes import format_bytes, parse_size

DEFAULT_DRAM = "1GiB"
DEFAULT_SSD_SIZE = "16GiB"  # when --ssd-dir is given without --ssd-size
DEFAULT_HTTP = "127.0.0.1:8791"

# The GIL switch interval (Python's: 5 ms): the event loop waits for the GIL up to this long
# beside workers doing a save's bookkeeping; lookups stand before a prefill, saves behind it, so
# quicker lookups are worth a few percent of save rate (docs/measurements.md).
SERVE_SWITCH_INTERVAL_S = 0.0005

ENV_PREFIX = "KVSTORE_"  # KVSTORE_DRAM=16Gi is --dram 16Gi (kvstore serve)


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """``kvstore serve``'s options (a config file and ``KVSTORE_*`` variables may set them)."""
    add_config_option(serve, ENV_PREFIX, "DRAM=16Gi")
    serve.add_argument("--socket", type=Path, default=None,
                       help="control socket path (default: $KVSTORE_SOCKET, else "
                            "$XDG_RUNTIME_DIR/kvstore/kvstore.sock, else /tmp/kvstore-$UID/...)")
    serve.add_argument("--socket-group", default=None, metavar="GROUP",
                       help="let this group's processes use the socket too (vLLM run as another "
                            "user): the socket 0660 and its folder 0710, the group's; every "
                            "peer's credentials are checked (default: the daemon's user only)")
    serve.add_argument("--dram", type=size_arg, default=parse_size(DEFAULT_DRAM), metavar="SIZE",
                       help=f"host DRAM pool, allocated at start (default {DEFAULT_DRAM})")
    serve.add_argument("--pin", choices=("auto", "yes", "no"), default="auto",
                       help="page-lock the DRAM pool for the GPU's copy engines: when CuPy sees "
                            "a GPU (auto, falling back to plain memory with a warning), required "
                            "(yes: refuse to start without it), or never (no)")
    serve.add_argument("--ssd-dir", type=Path, default=None, metavar="DIR",
                       help="directory of the SSD tier's files (default: no SSD tier)")
    serve.add_argument("--ssd-size", type=size_arg, default=None, metavar="SIZE",
                       help=f"SSD tier capacity; 0 turns it off (default {DEFAULT_SSD_SIZE} "
                            "with --ssd-dir)")
    serve.add_argument("--ssd-io", choices=("auto", "direct", "buffered"), default="auto",
                       help="SSD IO mode: O_DIRECT when the filesystem takes it (auto), "
                            "required (direct), or page cache + fdatasync (buffered)")
    serve.add_argument("--http", default=None, metavar="HOST:PORT",
                       help=f"admin HTTP address, or 'off' (default {DEFAULT_HTTP}, or a free "
                            "port on 127.0.0.1 when another daemon holds it)")
    serve.add_argument("--http-max-connections", type=positive_int_arg, default=64, metavar="N",
                       help="cap on the admin HTTP app's open connections: past it a new one "
                            "gets a 503; one that sends no request for 5 s is closed "
                            "(default 64)")
    serve.add_argument("--lease-ttl", type=positive_float_arg, default=30.0, metavar="SECONDS",
                       help="default lifetime of a lookup's lease (default 30)")
    serve.add_argument("--key-filter", choices=("on", "off"), default="on",
                       help="keep a filter of the block hashes held beside the socket, which "
                            "engines read to skip lookups sure to miss (a new conversation's "
                            "blocks), a round trip each (on); off: every prefix is asked about")
    serve.add_argument("--eviction", choices=("lru", "fifo"), default="lru",
                       help="which unpinned DRAM blocks make room first")
    serve.add_argument("--log-level", default="warning",
                       choices=("debug", "info", "warning", "error"),
                       help="log level of the daemon's loggers (stderr)")
    serve.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                       help="text: 'time level logger: message' (the start-up lines: the "
                            "message alone); json: one JSON object per line (time, level, "
                            "logger, message), the start-up lines included")
    serve.add_argument("--dumpable", action="store_true",
                       help="keep core dumps and debuggers (gdb, py-spy); by default the daemon "
                            "is not dumpable, so no other process of its user can open the "
                            "engines' arenas it maps through /proc/PID/fd or read its memory")
    add_limit_flags(serve)
    add_copy_flags(serve)
    serve.add_argument("--cluster", default=None, metavar="redis://HOST:PORT/DB",
                       help="share blocks with other daemons through this Redis index "
                            "(Redis 6.2+, standalone; default: no cluster)")
    serve.add_argument("--node-id", default=None, metavar="ID",
                       help="this daemon's unique name in the cluster (default: the host name)")
    serve.add_argument("--listen", default=None, metavar="HOST:PORT",
                       help="UCX address peers fetch blocks from (default 127.0.0.1:0, a free "
                            "port); the port is bound on every interface: firewall it")
    serve.add_argument("--advertise", default=None, metavar="HOST:PORT",
                       help="address peers dial, if not --listen's (needed with a wildcard "
                            "--listen host or behind NAT; default: --listen's address)")


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) into its parts; ValueError if malformed."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port_text)


def _check_ssd_dir(directory: Path) -> Path:
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--ssd-dir {directory} is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvstore-probe-"):
            pass
    except OSError as exc:
        raise UsageError(f"--ssd-dir {directory} is not usable: {exc.strerror or exc}") from None
    return directory.resolve()


def _store_config(args: argparse.Namespace, debug_hash_bits: int | None) -> Any:
    if args.dram <= 0:
        raise UsageError("--dram must be larger than 0")
    from kvstore.store.dram.host_memory import check_pool_fits

    try:  # the pool is faulted in at start: one too large would end in swap or the OOM killer
        check_pool_fits(args.dram)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ssd_size = args.ssd_size
    if ssd_size is None:
        ssd_size = parse_size(DEFAULT_SSD_SIZE) if args.ssd_dir is not None else 0
    if ssd_size > 0 and args.ssd_dir is None:
        raise UsageError("--ssd-size needs --ssd-dir")
    ssd_dir = _check_ssd_dir(args.ssd_dir) if ssd_size > 0 else None
    from kvstore.store.tiered import StoreConfig

    if ssd_dir is not None:  # refused now, not sparse files and ENOSPC at every demotion
        from kvstore.store.ssd.room import check_room

        try:
            check_room(ssd_dir, ssd_size, StoreConfig.ssd_max_file_bytes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    try:
        return StoreConfig(dram_bytes=args.dram, ssd_dir=ssd_dir, ssd_bytes=ssd_size,
                           pin_memory={"auto": None, "yes": True, "no": False}[args.pin],
                           eviction=args.eviction, lease_ttl_s=args.lease_ttl,
                           debug_hash_bits=debug_hash_bits, ssd_io_mode=args.ssd_io)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _cluster_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig of --cluster and its flags, or None without --cluster."""
    if args.cluster is None:
        given = [flag for flag, value in (("--node-id", args.node_id), ("--listen", args.listen),
                                          ("--advertise", args.advertise)) if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} need(s) --cluster redis://HOST:PORT/DB")
        return None
    from kvstore.cluster.config import ClusterConfig  # no redis or ucxx import: just parsing

    try:
        return ClusterConfig.from_args(args.cluster, node_id=args.node_id, listen=args.listen,
                                       advertise=args.advertise)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _start_cluster(config: Any, store: Any) -> tuple[Any, bool]:
    """Start a ClusterNode over ``store``: (node, registered in Redis). OSError if the peer
    port cannot be bound."""
    # ucxx sets UCX_MEMTYPE_CACHE itself, which this UCX no longer reads: without this, every
    # daemon starts with a two-line "unused environment variable" warning.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from kvstore.cluster.node import ClusterNode
    from kvstore.cluster.ucx.devices import restrict_to_listen_address

    if config.advertise_host == config.listen_host:  # peers dial the address we listen on
        restrict_to_listen_address(config.listen_host)  # before UCX starts: its data lanes too
    node = ClusterNode(config, store)
    try:
        registered = node.start()
    except Exception as exc:
        raise OSError(f"cannot listen for peers on port {config.listen_port}: {exc}") from None
    if not registered:
        logging.getLogger("kvstore.cli").warning(
            "Redis at %s:%d is unreachable: serving locally; node %s joins the cluster when it "
            "answers", config.redis_host, config.redis_port, config.node_id)
    return node, registered


def _admin_server(factory: Any, service: Any, addr: tuple[str, int], explicit: bool,
                  **kwargs: Any) -> Any:
    """The admin app on ``addr`` (``kwargs`` to ``factory``); when the address is the default
    (not asked for) and another daemon holds it, on a free port of the same host instead, with
    a warning."""
    try:
        return factory(service, *addr, **kwargs)
    except OSError as exc:
        if explicit:
            raise
        admin = factory(service, addr[0], 0, **kwargs)
        logging.getLogger("kvstore.cli").warning(
            "%s (another daemon?); admin HTTP on %s instead (--http picks one)", exc, admin.url)
        return admin


def serve_command(args: argparse.Namespace, switch_interval_s: float) -> int:
    """``kvstore serve``: set up the store, bind the socket (and the admin HTTP app, the cluster
    node), serve until stopped; the exit status. UsageError for options that do not fit."""
    cluster_config = _cluster_config(args)
    from kvstore.settings import default_socket_path, load_env_settings

    banner = configure(args.log_format, "kvstore.banner")
    logging.getLogger().setLevel(args.log_level.upper())
    if not args.dumpable:  # before any engine's arena is mapped here
        forbid_inspection()
    try:
        env = load_env_settings()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    http = DEFAULT_HTTP if args.http is None else args.http
    http = None if http.lower() in ("off", "none", "") else http
    try:
        http_addr = parse_host_port(http) if http else None
    except ValueError as exc:
        raise UsageError(f"--http: {exc}") from None
    config = _store_config(args, env.debug_hash_bits)
    try:
        copy_settings = copy_settings_from_args(args)
        limits = limits_from_args(args)  # before the pool is faulted in
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    socket_path = args.socket if args.socket is not None else default_socket_path()

    from kvstore.daemon.health import DaemonHealth
    from kvstore.daemon.server import Daemon
    from kvstore.daemon.service import Service
    from kvstore.store.dram.pool import PinError
    from kvstore.store.tiered import TieredStore
    from kvstore.wire.listener import SocketSetupError, check_socket_path
    from kvstore.wire.socket_access import SocketAccess

    try:  # before the pool is faulted in: a wrong folder costs a second, not the fault-in
        access = SocketAccess.of(args.socket_group)
        check_socket_path(socket_path, access)
    except (SocketSetupError, ValueError) as exc:
        banner.error("kvstore: error: %s", exc)
        return EXIT_FAILURE
    banner.info("kvstore: allocating the %s DRAM pool and faulting it in (about a second per "
                "7 GiB on an H200 host)...", format_bytes(config.dram_bytes))
    started = time.monotonic()
    try:
        store = TieredStore(config)
    except (OSError, ValueError, MemoryError) as exc:
        hint = " (--pin yes)" if args.pin == "yes" and isinstance(exc, PinError) else ""
        banner.error("kvstore: error: cannot set up the store%s: %s", hint, exc)
        return EXIT_FAILURE
    service = Service(store, default_lease_ttl_s=args.lease_ttl,
                      debug_hash_bits=env.debug_hash_bits, version=package_version(),
                      copy_settings=copy_settings, debug_corrupt_engine=env.debug_corrupt_engine,
                      max_registered_connections=limits.max_registered_connections,
                      key_filter=args.key_filter == "on")
    daemon = Daemon(service, socket_path, limits=limits, debug_stall_s=env.debug_stall_s,
                    access=access)
    health = DaemonHealth(service, daemon.heartbeat,
                          config.ssd_dir if config.ssd_bytes > 0 else None)
    admin = None
    cluster_line = None
    try:
        daemon.bind()
        if http_addr is not None:  # FastAPI's import is half a start: only when serving it
            from kvstore.daemon.admin import AdminServer

            admin = _admin_server(AdminServer, service, http_addr, explicit=args.http is not None,
                                  health=health, max_connections=args.http_max_connections)
        if cluster_config is not None:  # last: nothing after it can fail before serving
            node, registered = _start_cluster(cluster_config, store)
            service.attach_cluster(node)  # stopped by service.close(), before the store closes
            cluster_line = describe_cluster(cluster_config, node, registered)
    except (SocketSetupError, OSError) as exc:
        store.close()
        banner.error("kvstore: error: %s", exc)
        return EXIT_FAILURE
    banner.info("kvstore: store ready in %.1f s", time.monotonic() - started)
    for line in describe_start(config, store.stats(), daemon.socket_path,
                                admin.url if admin else None).splitlines():
        banner.info("%s", line)
    if cluster_line is not None:
        banner.info("%s", cluster_line)

    def ready() -> None:
        if env.debug_stall_stacks:  # diagnosis: a stalled loop's stacks beside the socket
            service.stalls.watch_stacks(daemon.heartbeat.interval_s, daemon.socket_path.parent)
        if admin is not None:
            admin.start()
        banner.info("kvstore: ready (pid %d)", os.getpid())

    switch_interval_before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    try:
        daemon.run(on_ready=ready)
    finally:
        sys.setswitchinterval(switch_interval_before)
        if admin is not None:
            admin.stop()
    banner.info("kvstore: stopped" + (f" (exit status {daemon.exit_code})"
                                        if daemon.exit_code else ""))
    return daemon.exit_code
