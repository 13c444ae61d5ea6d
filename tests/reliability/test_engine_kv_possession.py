"""Issue 32 item 5: another client of the same uid cannot write into a running engine's KV memory.

The attack the issue found: a second client registered a running engine's `/dev/shm/kvengine_*`
arena by name, loaded its own blocks into it, and the engine's next greedy answer changed. Here
a real `kvengine serve --kv-offload` runs against a real daemon, and a client of the same uid
tries every way in it has: whatever shared memory the engine maps by name, a guessed name, the
engine's own memfd reopened through /proc (a descriptor is no secret from the same uid), and the
engine's registration id (from `locate`) with save, load, resident and unregister. Every try that
registers is followed by a load of the attacker's blocks over the whole arena, as in the attack.
Each is refused, nothing of the engine is in /dev/shm, and its answers never change. The same
holds after the engine restarts and after the daemon restarts (the engine registers again with
fresh descriptors, and saves and restores through them).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
from daemon_helpers import RunningDaemon, make_chain, wait_until
from engine_process import EngineProcess
from support.arena import ShmArena

from kvstore.layout import KVLayout, Region
from kvstore.wire.client import Client, ClientError

pytestmark = pytest.mark.timeout(300)

ATTACK_BLOCK_BYTES = 4096
PROMPT = np.random.default_rng(32).integers(10, 1000, 16 * 6 + 3).tolist()
OTHER_PROMPT = np.random.default_rng(33).integers(10, 1000, 16 * 4 + 5).tolist()
NEW_PROMPT = np.random.default_rng(34).integers(10, 1000, 16 * 4 + 7).tolist()


def _complete(engine: EngineProcess, prompt: list[int]) -> tuple[str, dict]:
    """The greedy answer and the prompt's cached tokens by tier."""
    response = httpx.post(engine.url + "/v1/completions", timeout=120, json={
        "model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True})
    response.raise_for_status()
    body = response.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["text"], details.get("cached_tokens_by_tier") or {}


def _shm_names(pid: int) -> list[str]:
    """Every /dev/shm file the process maps or holds open."""
    found = set(re.findall(r"/dev/shm/(\S+)", Path(f"/proc/{pid}/maps").read_text()))
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(entry)
            if target.startswith("/dev/shm/"):
                found.add(target[len("/dev/shm/"):])
    return sorted(found)


def _memfd_paths(pid: int) -> list[str]:
    """/proc paths of the process's anonymous shared memory (its arena and generations)."""
    paths = []
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(entry).startswith("/memfd:kvengine"):
                paths.append(str(entry))
    return paths


def _registrations(daemon: RunningDaemon) -> int:
    with daemon.client() as c:
        return c.stats()["daemon"]["registrations"]


def _victim_layout(handle: str | int, size_bytes: int, fds: tuple[int, ...] = ()) -> KVLayout:
    """All of ``size_bytes`` of memory as blocks of at most ATTACK_BLOCK_BYTES."""
    block = min(ATTACK_BLOCK_BYTES, size_bytes)
    return KVLayout(size_bytes // block, (Region(handle, size_bytes, 0, block, block),),
                    dtype="float32", **({"fds": fds} if fds else {}))


def _overwrite(attacker: Client, victim_layout: KVLayout) -> str:
    """Register ``victim_layout`` and, if the daemon takes it, load the attacker's own blocks
    over all of it (the issue's attack); what happened, as a short line."""
    try:
        victim = attacker.register(victim_layout, "attacker-victim")
    except ClientError as exc:
        return f"refused: {exc.code} ({exc.message[:60]})"
    num_blocks = victim_layout.num_blocks
    garbage = ShmArena(num_blocks, victim_layout.block_bytes, seed=None)
    try:
        values = garbage.blocks.view(np.float32)
        values[:] = np.random.default_rng(5).normal(0, 30, values.shape)
        own = attacker.register(garbage.layout, "attacker-own")
        chain = make_chain("possession-attack", num_blocks, seed=7)
        attacker.save(own, chain.namespace, range(num_blocks), chain.hashes, chain.idents)
        hit = attacker.lookup(chain.namespace, chain.hashes, chain.idents)
        loaded = attacker.load(victim, hit.lease_id, range(hit.num_hit))
        attacker.unregister(own)
        return f"accepted: {loaded} blocks loaded into the engine's memory"
    finally:
        garbage.close()


def _attack(daemon: RunningDaemon, pid: int) -> dict[str, str]:
    """Every way in a client of the same uid has; what each got."""
    outcomes: dict[str, str] = {}
    with daemon.client() as attacker:
        # 1. By name: whatever the engine maps from /dev/shm, and a guess at its name.
        for name in _shm_names(pid) + [f"kvengine_{pid}_000000000000"]:
            path = Path("/dev/shm") / name
            size = path.stat().st_size if path.exists() else 64 * ATTACK_BLOCK_BYTES
            outcomes[f"name {name}"] = _overwrite(attacker, _victim_layout(name, size))
        # 2. By descriptor: the engine's memfds reopened through /proc, as the uid may.
        for fd_path in _memfd_paths(pid):
            fd = os.open(fd_path, os.O_RDWR)
            try:
                layout = _victim_layout(0, os.fstat(fd).st_size, (fd,))
                outcomes[f"descriptor {fd_path}"] = _overwrite(attacker, layout)
            finally:
                os.close(fd)
        # 3. The engine's own registration, from this connection.
        probe = make_chain("possession-probe", 1, seed=8)
        engines = attacker.locate(probe.namespace, probe.hashes, probe.idents).engines
        outcomes["engines located"] = str(len(engines))
        garbage = ShmArena(2, ATTACK_BLOCK_BYTES, seed=9)
        try:
            own = attacker.register(garbage.layout, "attacker-lease")
            attacker.save(own, probe.namespace, [0], probe.hashes, probe.idents)
            for engine in engines:
                reg = engine.registration_id
                hit = attacker.lookup(probe.namespace, probe.hashes, probe.idents)
                tries = {
                    "load": lambda r=reg, h=hit: attacker.load(r, h.lease_id, [0]),
                    "save": lambda r=reg: attacker.save(r, probe.namespace, [0], probe.hashes,
                                                        probe.idents),
                    "resident": lambda r=reg: attacker.resident(
                        r, probe.namespace, [0], probe.hashes, probe.idents, [1]),
                }
                for verb, attempt in tries.items():
                    try:
                        outcomes[f"{verb} into registration {reg}"] = f"accepted: {attempt()}"
                    except ClientError as exc:
                        outcomes[f"{verb} into registration {reg}"] = f"refused: {exc.code}"
                unregistered = attacker.unregister(reg)
                outcomes[f"unregister {reg}"] = "accepted" if unregistered else "refused"
                attacker.release(hit.lease_id)
        finally:
            garbage.close()
    return outcomes


def _assert_refused(outcomes: dict[str, str]) -> None:
    accepted = {k: v for k, v in outcomes.items()
                if k != "engines located" and not v.startswith("refused")}
    assert not accepted, f"a foreign client got into the engine's memory: {accepted}"
    assert outcomes["engines located"] != "0"  # the registration was there to attack
    # The engine's memory (arena and generations), reopened, is refused as held, not as
    # malformed: the daemon saw it and said it belongs to a live registration.
    held = [k for k, v in outcomes.items() if k.startswith("descriptor")]
    assert len(held) >= 2, outcomes
    assert all(outcomes[k].startswith("refused: permission_denied (") for k in held), outcomes


def _assert_anonymous(pid: int) -> None:
    assert _shm_names(pid) == [], "the engine has KV memory in /dev/shm, openable by name"
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "/memfd:kvengine-arena" in maps and "/memfd:kvengine-generations" in maps


def _engine(model: Path, daemon: RunningDaemon) -> EngineProcess:
    return EngineProcess(model, "--kv-offload", "--kv-store-socket", str(daemon.socket_path))


def test_a_foreign_client_cannot_write_into_a_running_engine(tiny_model_dir, make_daemon):
    daemon = make_daemon(dram="64MiB")
    with _engine(tiny_model_dir, daemon) as engine:
        assert wait_until(lambda: _registrations(daemon) == 1, timeout_s=30)
        answer, _ = _complete(engine, PROMPT)
        again, cached = _complete(engine, PROMPT)  # from the engine's own HBM prefix cache
        assert again == answer and cached.get("hbm", 0) >= 16 * 6
        outcomes = _attack(daemon, engine.proc.pid)
        after, cached = _complete(engine, PROMPT)
        assert after == answer, f"the engine's answer changed under {outcomes}"
        assert cached.get("hbm", 0) >= 16 * 6  # still read from the memory attacked
        _assert_refused(outcomes)
        _assert_anonymous(engine.proc.pid)
        assert _registrations(daemon) == 1  # the engine's, untouched


def test_a_restarted_engine_registers_its_new_memory(tiny_model_dir, make_daemon):
    daemon = make_daemon(dram="64MiB")
    with _engine(tiny_model_dir, daemon) as first:
        assert wait_until(lambda: _registrations(daemon) == 1, timeout_s=30)
        answer, _ = _complete(first, PROMPT)  # saved write-through into DRAM
        with daemon.client() as c:
            assert wait_until(lambda: c.stats()["tiers"]["dram"]["blocks"] >= 6, timeout_s=20)
    assert wait_until(lambda: _registrations(daemon) == 0, timeout_s=10)
    with _engine(tiny_model_dir, daemon) as second:
        assert wait_until(lambda: _registrations(daemon) == 1, timeout_s=30)
        _assert_anonymous(second.proc.pid)
        text, cached = _complete(second, PROMPT)
        assert text == answer and cached.get("dram", 0) >= 16 * 6  # restored through its fd
        _assert_refused(_attack(daemon, second.proc.pid))
        assert _complete(second, PROMPT)[0] == answer


def test_after_a_daemon_restart_the_engine_registers_fresh_descriptors(tiny_model_dir,
                                                                       make_daemon):
    daemon = make_daemon(dram="64MiB")
    with _engine(tiny_model_dir, daemon) as engine:
        assert wait_until(lambda: _registrations(daemon) == 1, timeout_s=30)
        answer, _ = _complete(engine, PROMPT)
        socket_path = daemon.socket_path
        daemon.kill9()
        daemon = make_daemon(dram="64MiB", socket_path=socket_path)

        def registered_again() -> bool:
            _complete(engine, OTHER_PROMPT)  # a request makes the engine reconnect
            return _registrations(daemon) == 1

        assert wait_until(registered_again, timeout_s=30, interval_s=0.2)
        _assert_anonymous(engine.proc.pid)
        # A prompt computed now is saved into the new daemon, which copies it out of the memory
        # it mapped from those descriptors.
        _complete(engine, NEW_PROMPT)
        with daemon.client() as c:
            assert wait_until(lambda: c.stats()["tiers"]["dram"]["blocks"] >= 4, timeout_s=20)
        _assert_refused(_attack(daemon, engine.proc.pid))
        assert _complete(engine, PROMPT)[0] == answer


@pytest.mark.gpu
def test_a_live_cuda_handle_cannot_be_registered_or_used_by_another_connection(make_daemon):
    """The CUDA path: an IPC handle leaks nothing but itself, so a second registration of it
    while its registration lives is refused, from any connection, and the owner's registration
    takes no save, load or resident from another connection; the arena keeps its bytes."""
    import cupy as cp
    from support.arena import CudaArena

    daemon = make_daemon(dram="256MiB")
    block_bytes = 64 * 1024
    arena = CudaArena(8, block_bytes, seed=3)
    before = arena.blocks(list(range(8)))
    chain = make_chain("possession-gpu", 2, seed=4)
    with daemon.client() as owner, daemon.client() as other:
        reg = owner.register(arena.layout, "gpu-engine")
        for client in (other, owner):
            with pytest.raises(ClientError) as info:
                client.register(arena.layout, "thief")
            assert info.value.code == "permission_denied"
            assert "registered already" in info.value.message
        # The other connection's own memory, with the chain saved from it.
        garbage = ShmArena(8, block_bytes, seed=5)
        try:
            own = other.register(garbage.layout, "thief-own")
            other.save(own, chain.namespace, [0, 1], chain.hashes, chain.idents)
            hit = other.lookup(chain.namespace, chain.hashes, chain.idents)
            with pytest.raises(ClientError) as info:
                other.load(reg, hit.lease_id, [0, 1])
            assert info.value.code == "not_found"
            with pytest.raises(ClientError) as info:
                other.save(reg, chain.namespace, [0, 1], chain.hashes, chain.idents)
            assert info.value.code == "not_found"
            assert other.unregister(reg) is False
            other.release(hit.lease_id)
        finally:
            garbage.close()
        cp.cuda.Device().synchronize()
        assert np.array_equal(arena.blocks(list(range(8))), before)
        assert owner.unregister(reg)
        # Once the owner's registration is gone, the handle may be registered again.
        assert other.unregister(other.register(arena.layout, "next"))
