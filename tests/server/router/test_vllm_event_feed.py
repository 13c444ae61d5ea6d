"""The router's view of vLLM engines: KV event batches decoded in both encodings vLLM has used,
blocks keyed by our own chain over their token ids (so a prompt keyed by ``VllmKeys`` finds
them), and a feed over real ZMQ sockets that fills gaps from the replay socket or forgets what
it can no longer trust. The publisher here speaks vLLM's wire protocol (PUB frames ``[topic,
seq, payload]``, a ROUTER replay socket answering a start ``seq`` with buffered batches and an
end marker); ``test_vllm_router_e2e.py`` runs vLLM's own publisher and engines.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import asdict

import msgpack
import pytest

zmq = pytest.importorskip("zmq")

from kvstore.keys import ModelIdentity  # noqa: E402
from offload.external.block_keys import KeyMaker  # noqa: E402
from offload.vllm.model_identity import vllm_identity  # noqa: E402
from server.router.engine_residency import EngineResidency  # noqa: E402
from server.router.kv_event_feed import KVEventFeed  # noqa: E402
from server.router.vllm_events import (  # noqa: E402
    Cleared,
    EventFormatError,
    Removed,
    Stored,
    decode_batch,
    first_block_salt,
)
from server.router.vllm_keys import VllmKeys  # noqa: E402
from server.router.vllm_meter import MIN_TOKENS, VllmMeter, parse_metrics  # noqa: E402

BS = 4


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 997 + 1 for i in range(n)]


def stored_map(hashes, parent, tokens, medium="GPU", extra=None, lora=None) -> dict:
    """A BlockStored as vLLM 0.11+ encodes it (a map tagged with its class name)."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium,
             "lora_name": lora}
    if extra is not None:
        event["extra_keys"] = extra
    return event


def batch(*events, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, list(events)], use_bin_type=True)


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# ---- decoding ------------------------------------------------------------------------------

def test_both_encodings_decode_to_the_same_events() -> None:
    tokens = _tokens(1, 2 * BS)
    new = decode_batch(batch(stored_map([b"h1", b"h2"], None, tokens),
                             {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"},
                             {"type": "AllBlocksCleared"}))
    # before vLLM 0.11: arrays, tag first, fields in order, trailing defaults left out; int hashes
    old = decode_batch(msgpack.packb([1.0, [["BlockStored", [11, 12], None, tokens, BS, None],
                                            ["BlockRemoved", [11]], ["AllBlocksCleared"]], 0]))
    assert new.events == [Stored([b"h1", b"h2"], None, tokens, BS, "GPU"),
                          Removed([b"h1"], "GPU"), Cleared()]
    assert old.events == [Stored([11, 12], None, tokens, BS), Removed([11]), Cleared()]
    assert old.data_parallel_rank == 0
    # an event type this router does not know is skipped, not an error
    assert decode_batch(batch({"type": "SomethingNew", "x": 1})).events == []


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, "events"]),
    batch({"block_hashes": [b"x"]}),  # no type
    batch(stored_map([b"h1"], None, [1, 2, 3])),  # 3 tokens for a block of 4
    batch(stored_map([b"h1"], None, [1, 2, 3, "4"])),
    batch(stored_map([b"h1"], None, _tokens(1, BS), extra=[None, None])),  # 2 extras, 1 block
    batch({"type": "BlockRemoved", "block_hashes": "h1"}),
    batch({"type": "BlockStored", "block_hashes": [b"h1"]}),  # fields missing
    msgpack.packb([1.0, [["BlockRemoved", [1], "GPU", 0, "LOCAL", "x", "too many"]]]),
])
def test_unreadable_batches_are_refused(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_vllms_own_encoder_is_read() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")
    tokens = _tokens(3, 2 * BS)
    event = kv_events.BlockStored(block_hashes=[b"a" * 32, b"b" * 32], parent_block_hash=None,
                                  token_ids=tokens, block_size=BS, lora_id=None, medium="GPU",
                                  lora_name=None, extra_keys=[("salt-x",), None])
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=2.0, events=[
        event, kv_events.BlockRemoved(block_hashes=[b"b" * 32], medium="GPU"),
        kv_events.AllBlocksCleared()]))
    got = decode_batch(payload).events
    assert isinstance(got[0], Stored) and got[0].token_ids == tokens
    assert first_block_salt(got[0]) == ("salt-x", True)
    assert isinstance(got[1], Removed) and isinstance(got[2], Cleared)


def test_salts_and_what_cannot_be_keyed() -> None:
    tokens = _tokens(1, 2 * BS)
    assert first_block_salt(Stored([1, 2], None, tokens, BS)) == ("", True)
    assert first_block_salt(Stored([1, 2], None, tokens, BS, extra_keys=[["s"], None])) == \
        ("s", True)
    # every block of a LoRA request carries its name first; the salt follows on the first
    lora = Stored([1, 2], None, tokens, BS, lora_name="ad", extra_keys=[["ad", "s"], ["ad"]])
    assert first_block_salt(lora) == ("s", True)
    images = Stored([1, 2], None, tokens, BS, extra_keys=[[["img", 0]], None])
    assert first_block_salt(images) == ("", False)
    embeds = Stored([1, 2], None, tokens, BS, extra_keys=[[b"digest"], None])
    assert first_block_salt(embeds) == ("", False)


# ---- residency -----------------------------------------------------------------------------

def test_stored_blocks_are_found_by_the_prompts_keys() -> None:
    residency, keys = EngineResidency(), VllmKeys()
    prompt = _tokens(5, 5 * BS + 1)
    chain = keys.event_chain(prompt, "", BS)
    assert len(chain) == 5  # the last token is left to compute
    assert residency.held(chain) == 0
    # two steps' events: blocks 0-1, then 2-3 chained on block 1 by vLLM's hash
    residency.apply([Stored([101, 102], None, prompt[:2 * BS], BS)])
    residency.apply([Stored([103, 104], 102, prompt[2 * BS:4 * BS], BS)])
    assert residency.held(chain) == 4
    assert residency.held(keys.event_chain(prompt, "tenant-b", BS)) == 0  # another tenant
    residency.apply([Removed([103])])
    assert residency.held(chain) == 2
    residency.apply([Removed([104], medium="CPU")])  # a connector's event: not vLLM's HBM
    residency.apply([Stored([105], None, prompt[:BS], BS, medium="CPU")])
    assert residency.stats()["blocks"] == 3
    residency.apply([Cleared()])
    assert residency.held(chain) == 0


def test_salted_chains_and_unknown_parents() -> None:
    residency, keys = EngineResidency(), VllmKeys()
    prompt = _tokens(6, 3 * BS + 1)
    residency.apply([Stored([1, 2], None, prompt[:2 * BS], BS, extra_keys=[["t1"], None])])
    assert residency.held(keys.event_chain(prompt, "t1", BS)) == 2
    assert residency.held(keys.event_chain(prompt, "", BS)) == 0
    # a block whose parent was never seen cannot be keyed: counted, never guessed
    residency.apply([Stored([3], 999, prompt[2 * BS:3 * BS], BS)])
    assert residency.stats()["unkeyed_blocks"] == 1
    assert residency.held(keys.event_chain(prompt, "t1", BS)) == 2


def test_the_table_is_bounded_oldest_first() -> None:
    residency, keys = EngineResidency(max_blocks=3), VllmKeys()
    prompt = _tokens(7, 5 * BS + 1)
    residency.apply([Stored([1, 2, 3, 4, 5], None, prompt[:5 * BS], BS)])
    assert residency.stats()["blocks"] == 3 and residency.stats()["dropped_blocks"] == 2
    assert residency.held(keys.event_chain(prompt, "", BS)) == 0  # the head went first


def _metrics(running: float, computed: float, prefill_s: float) -> bytes:
    return (b'# HELP vllm:num_requests_running Number of requests in model execution.\n'
            b'vllm:num_requests_running{engine="0",model_name="m x"} %f\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m x"} 2.0\n'
            b'vllm:num_requests_waiting_by_reason{reason="x"} 7.0\n'
            b'vllm:num_requests_running{engine="1",model_name="m x"} 1.0 1700000000\n'
            b'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} %f\n'
            b'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 9999.0\n'
            b'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} %f\n'
            b'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0\n'
            % (running, computed, prefill_s))


def test_load_and_prefill_rate_from_vllms_metrics() -> None:
    sample = parse_metrics(_metrics(3, 100, 0.5))
    assert (sample.load, sample.computed_tokens, sample.prefill_s) == (6, 100, 0.5)
    with pytest.raises(ValueError):
        parse_metrics(b"kvengine:num_requests_running 3\n")
    meter = VllmMeter()
    assert not meter.update(sample).prefill_measured  # the first probe: the priors
    assert not meter.update(parse_metrics(_metrics(0, 100 + MIN_TOKENS - 1, 1.0))).prefill_measured
    costs = meter.update(parse_metrics(_metrics(0, 100 + 2000, 2.5)))
    assert costs.prefill_measured and costs.prefill_s_per_token == pytest.approx(2.0 / 2000)
    # a restarted vLLM (its counters went back) starts the measurement again
    assert not meter.update(parse_metrics(_metrics(0, 10, 0.1))).prefill_measured


def test_the_connectors_identity_comes_from_the_daemon() -> None:
    identity = vllm_identity("Qwen3ForCausalLM", 2, 2, 32, "bfloat16", BS, "dir:abc", "cpu:x")
    other = vllm_identity("Qwen3ForCausalLM", 2, 2, 32, "bfloat16", BS, "dir:zzz", "cpu:x")
    kvengine = ModelIdentity("Qwen3ForCausalLM", 2, 2, 32, "bfloat16", BS, "dir:abc")
    keys = VllmKeys()
    prompt = _tokens(8, 3 * BS + 1)
    assert keys.store_chain(prompt, "") is None  # nothing known yet
    keys.learn([{"model_identity": asdict(kvengine)}, {"model_identity": None},
                {"model_identity": {"architecture": "vllm:broken"}}])
    assert keys.connector is None
    keys.learn([{"model_identity": asdict(identity), "num_shards": 1}])
    chain = keys.store_chain(prompt, "salt")
    want = KeyMaker(identity).keys(prompt, "salt", None, num_blocks=3)
    assert (chain.namespace, chain.hashes, chain.idents) == (want.namespace, want.hashes,
                                                              want.idents)
    # two vLLM models at one daemon and neither is ours: keep what was known
    keys.learn([{"model_identity": asdict(identity)}, {"model_identity": asdict(other)}])
    assert keys.connector.identity == identity
    keys.learn([{"model_identity": asdict(other), "num_shards": 2}])
    assert keys.connector.identity == other and keys.num_shards == 2
    assert keys.store_chain(prompt, "").namespace != KeyMaker(other).namespace(None, None)


# ---- the feed over ZMQ ---------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Publisher:
    """vLLM's publisher protocol: PUB ``[topic, seq, payload]``; a ROUTER replay socket answers
    ``[b"", start_seq]`` with every buffered batch from there, then ``seq`` -1."""

    def __init__(self, replay: bool = True) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{_port()}"
        self.pub.bind(self.endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_endpoint = None
        self._stop = threading.Event()
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.replay_endpoint = f"tcp://127.0.0.1:{_port()}"
            self.router.bind(self.replay_endpoint)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"),
                                                payload))
            self.router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                        b""))

    def publish(self, payload: bytes, send: bool = True) -> None:
        """Batch number ``self.seq``; ``send=False`` buffers it without sending (a lost one)."""
        self.buffer.append((self.seq, payload))
        if send:
            self.pub.send_multipart((b"kv", self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def close(self) -> None:
        self._stop.set()
        if self.replay_endpoint:
            self._thread.join(2)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


@pytest.fixture
def publisher():
    made: list[Publisher] = []

    def make(replay: bool = True) -> Publisher:
        made.append(Publisher(replay))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _feed(pub: Publisher) -> KVEventFeed:
    feed = KVEventFeed("0", pub.endpoint, EngineResidency(), pub.replay_endpoint,
                       replay_timeout_s=1.0, poll_s=0.02)
    feed.start()
    return feed


def _joined(pub: Publisher, feed: KVEventFeed) -> None:
    """Publish empty batches until the subscriber sees one (a SUB misses what came before)."""
    assert wait_until(lambda: (pub.publish(batch()), time.sleep(0.02),
                               feed.counters["batches"])[-1] > 0)


def test_a_gap_is_filled_from_the_replay_socket(publisher) -> None:
    pub = publisher()
    feed = _feed(pub)
    try:
        _joined(pub, feed)
        prompt = _tokens(9, 3 * BS + 1)
        chain = VllmKeys().event_chain(prompt, "", BS)
        pub.publish(batch(stored_map([b"a"], None, prompt[:BS])), send=False)  # lost
        pub.publish(batch(stored_map([b"b", b"c"], b"a", prompt[BS:3 * BS])))
        assert wait_until(lambda: feed.residency.held(chain) == 3)
        assert feed.counters["gaps"] == 1 and feed.counters["replayed_batches"] >= 1
        assert feed.residency.stats().get("resyncs", 0) == 0
    finally:
        feed.stop()


def test_a_gap_without_replay_forgets_and_a_restart_forgets(publisher) -> None:
    pub = publisher(replay=False)
    feed = _feed(pub)
    try:
        _joined(pub, feed)
        prompt = _tokens(10, 2 * BS + 1)
        chain = VllmKeys().event_chain(prompt, "", BS)
        pub.publish(batch(stored_map([b"a", b"b"], None, prompt[:2 * BS])))
        assert wait_until(lambda: feed.residency.held(chain) == 2)
        pub.publish(batch({"type": "BlockRemoved", "block_hashes": [b"b"]}), send=False)
        pub.publish(batch())  # the gap: a removal may have been missed
        assert wait_until(lambda: feed.counters["gaps"] == 1)
        assert feed.residency.held(chain) == 0 and feed.residency.stats()["resyncs"] == 1
        pub.publish(batch(stored_map([b"a", b"b"], None, prompt[:2 * BS])))
        assert wait_until(lambda: feed.residency.held(chain) == 2)
        pub.seq = 0  # the engine restarted: its cache is empty and its sequence starts again
        pub.publish(batch())
        assert wait_until(lambda: feed.counters["restarts"] == 1)
        assert feed.residency.held(chain) == 0
    finally:
        feed.stop()


def test_unreadable_batches_are_counted_and_the_feed_goes_on(publisher) -> None:
    pub = publisher(replay=False)
    feed = _feed(pub)
    try:
        _joined(pub, feed)
        pub.publish(b"\xc1 not msgpack")
        pub.pub.send_multipart((b"kv", b"short"))  # two frames
        prompt = _tokens(11, BS + 1)
        pub.publish(batch(stored_map([b"a"], None, prompt[:BS])))
        chain = VllmKeys().event_chain(prompt, "", BS)
        assert wait_until(lambda: feed.residency.held(chain) == 1)
        assert feed.counters["unreadable"] == 2
    finally:
        started = time.monotonic()
        feed.stop()
        assert time.monotonic() - started < 2.0


def test_a_late_subscriber_catches_up_from_the_replay_buffer(publisher) -> None:
    pub = publisher()
    prompt = _tokens(12, 2 * BS + 1)
    pub.publish(batch(stored_map([b"a", b"b"], None, prompt[:2 * BS])))  # before anyone listens
    feed = _feed(pub)
    try:
        _joined(pub, feed)
        assert wait_until(lambda: feed.residency.held(
            VllmKeys().event_chain(prompt, "", BS)) == 2)
    finally:
        feed.stop()
