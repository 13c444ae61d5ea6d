"""The background plan builder (kernels/plan_builder.py) on CPU: a real child process, real pipes
and frames; the build target is a small module written here in place of cuDNN (which needs a
GPU: tests/engine/test_first_use_gpu.py runs the cuDNN target)."""

from __future__ import annotations

import io
import json
import struct
import time

import pytest

from kernels.plan_builder import Built, PlanBuilder, Refused
from kernels.plan_frames import decode_key, encode_key, read_frame, write_frame

TARGETS = '''
import json, os, time

def echo(key, device):
    return json.dumps({"key": list(key), "device": device}).encode()

def picky(key, device):
    if key[0] == "bad":
        raise ValueError("no graph for this shape")
    return b"ok"

def slow(key, device):
    time.sleep(key[1])
    return b"late"

def crash(key, device):
    os._exit(3)
'''


@pytest.fixture
def targets(tmp_path, monkeypatch) -> str:
    (tmp_path / "plan_targets.py").write_text(TARGETS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "plan_targets"


def _wait(builder: PlanBuilder, name: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outcome = builder.take(name)
        if outcome is not None:
            return outcome
        time.sleep(0.02)
    raise AssertionError(f"no answer for {name} in {timeout} s")


def test_keys_and_frames_round_trip() -> None:
    for key in [(True, False, 3, 1024, 512, 32, 8, 128, 16, (6726, 262144), 0.08838834764831845),
                ("split", True, 4, 17, 256, 32, 8, 128, 16, (100, 4096), 1.0),
                ("exact", 2048, 16384, 32, 8, 128, 0.125)]:
        back = decode_key(json.loads(json.dumps(encode_key(key))))
        assert repr(back) == repr(key)  # the plan cache names a key by its repr: types count
    assert repr(decode_key(json.loads(json.dumps(encode_key((1.0, True)))))) == "(1.0, True)"
    stream = io.BytesIO()
    write_frame(stream, {"name": "a"}, b"\x00\x01blob")
    write_frame(stream, {"name": "b"})
    stream.seek(0)
    assert read_frame(stream) == ({"name": "a", "size": 6}, b"\x00\x01blob")
    assert read_frame(stream) == ({"name": "b", "size": 0}, b"")
    assert read_frame(stream) is None


@pytest.mark.parametrize("raw", [
    struct.pack(">I", 0),  # an empty header
    struct.pack(">I", 1 << 20),  # a header past its bound
    struct.pack(">I", 10) + b"{",  # cut inside the header
    struct.pack(">I", 12) + b'{"size": -1}',  # a negative size
    struct.pack(">I", 19) + b'{"size": 999999999}',  # a blob past its bound
    struct.pack(">I", 11) + b'{"size": 4}' + b"ab",  # cut inside the blob
])
def test_malformed_frames_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        read_frame(io.BytesIO(raw))


def test_shapes_are_built_in_a_child_and_taken_once(targets: str) -> None:
    builder = PlanBuilder(device=2, target=f"{targets}:echo", idle_s=10.0)
    try:
        key = ("split", False, 24, 64, (100, 4096), 0.125)
        assert builder.submit("n1", key)
        assert builder.submit("n1", key)  # the same shape is sent once
        assert builder.knows("n1")
        outcome = _wait(builder, "n1")
        assert isinstance(outcome, Built)
        assert json.loads(outcome.blob) == {"key": encode_key(key), "device": 2}
        assert builder.take("n1") is None and not builder.knows("n1")
        assert builder.finished() == []
        assert builder.counts["submitted"] == 1 and builder.counts["built"] == 1
    finally:
        builder.close()


def test_finished_names_the_results_waiting_to_be_taken_oldest_first(targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:echo", idle_s=10.0)
    try:
        for name in ("a", "b"):
            assert builder.submit(name, ("split", name))
            deadline = time.monotonic() + 20
            while name not in builder.finished() and time.monotonic() < deadline:
                time.sleep(0.02)
        assert builder.finished() == ["a", "b"]
        assert isinstance(builder.take("a"), Built)
        assert builder.finished() == ["b"]
    finally:
        builder.close()


def test_a_refused_shape_comes_back_with_the_reason(targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:picky")
    try:
        builder.submit("bad", ("bad", 1))
        builder.submit("good", ("good", 1))
        refused, built = _wait(builder, "bad"), _wait(builder, "good")
        assert isinstance(refused, Refused) and "no graph for this shape" in refused.reason
        assert isinstance(built, Built) and built.blob == b"ok"
    finally:
        builder.close()


def test_an_idle_child_leaves_and_the_next_shape_starts_another(targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:echo", idle_s=0.3)
    try:
        builder.submit("a", ("a",))
        assert isinstance(_wait(builder, "a"), Built)
        first = builder._child.process
        first.wait(timeout=10)  # left on its own after 0.3 s without work
        assert first.returncode == 0
        builder.submit("b", ("b",))
        assert isinstance(_wait(builder, "b"), Built)
        assert builder.counts["starts"] == 2 and builder.counts["crashes"] == 0
    finally:
        builder.close()


def test_a_build_past_its_bound_is_stopped_and_refused(targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:slow", build_timeout_s=0.5)
    try:
        builder.submit("hang", ("hang", 60))
        builder.submit("behind", ("behind", 0))  # queued behind it, never tried
        child = builder._child.process
        time.sleep(0.6)
        start = time.monotonic()
        outcome = builder.take("hang")
        assert time.monotonic() - start < 0.2  # the step thread never waits for the kill
        assert isinstance(outcome, Refused) and "ran past" in outcome.reason
        assert child.wait(timeout=10) is not None  # the child was stopped, not left building
        assert builder.take("behind") is None and not builder.knows("behind")  # sent again
        assert builder.counts["timeouts"] == 1 and builder.counts["dropped"] == 1
        assert builder.counts["crashes"] == 0
        builder.submit("quick", ("quick", 0))  # a new child serves the next shape
        assert isinstance(_wait(builder, "quick"), Built)
    finally:
        builder.close()


def test_a_child_that_keeps_crashing_turns_the_builder_off(targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:crash", max_crashes=2)
    try:
        for attempt in range(2):
            assert builder.submit(f"k{attempt}", ("k", attempt))
            # the shape it died on is refused (sent again it would kill the next child), and
            # the death is counted once
            outcome = _wait(builder, f"k{attempt}")
            assert isinstance(outcome, Refused) and "died building it" in outcome.reason
            assert builder.counts["crashes"] == attempt + 1
        assert builder.counts["dropped"] == 0
        assert not builder.enabled
        assert builder.submit("k9", ("k", 9)) is False  # the caller builds in line again
    finally:
        builder.close()


def test_a_malformed_answer_is_one_crash_and_refuses_its_shape(targets: str, tmp_path) -> None:
    (tmp_path / "noisy_target.py").write_text(
        "import os\n"
        "def noisy(key, device):\n"
        # descriptor 3: the answers' stream, the child's first free one when it starts
        "    os.write(3, b'\\x00\\x00\\x00\\x05{bad}')  # a frame, not JSON\n"
        "    return b''\n")
    builder = PlanBuilder(device=0, target="noisy_target:noisy")
    try:
        builder.submit("n", ("n",))
        outcome = _wait(builder, "n")
        assert isinstance(outcome, Refused) and "unreadable answer" in outcome.reason
        assert builder.counts["crashes"] == 1 and builder.enabled
    finally:
        builder.close()


def test_close_ends_the_child(targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:slow")
    builder.submit("s", ("s", 30))
    child = builder._child.process
    builder.close()
    assert child.poll() is not None


def test_a_full_queue_leaves_the_shape_to_the_callers_kernel_until_it_comes_again(
        targets: str) -> None:
    builder = PlanBuilder(device=0, target=f"{targets}:slow", max_pending=1)
    try:
        assert builder.submit("first", ("first", 0.5))
        assert builder.submit("second", ("second", 0))  # served meanwhile, not queued
        assert builder.counts["queue_full"] == 1 and not builder.knows("second")
        assert isinstance(_wait(builder, "first"), Built)
        assert builder.submit("second", ("second", 0))  # it came again: queued now
        assert isinstance(_wait(builder, "second"), Built)
    finally:
        builder.close()
