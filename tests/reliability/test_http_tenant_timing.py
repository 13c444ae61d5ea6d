"""Issue 21.4: tenant B learned what tenant A sent, from the time of a refused request. The prompt
tokenizer's cache was shared by all tenants: B's 400 (a prompt plus max_tokens over the context)
came back at p50 2.65 ms if A had sent the text, 7.23 ms if not.

Paired timing test on a real server: B probes texts A sent and texts nobody sent, interleaved;
B's time must not depend on A. A control shows the probe can see a cache hit at all: B probing
its own earlier text is clearly faster.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest
from engine_process import EngineProcess, tiny_model

pytestmark = pytest.mark.timeout(240)

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
NUM_PAIRS = 20
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    model_dir = tiny_model(tmp_path_factory.mktemp("tenant-timing") / "tiny")
    running = EngineProcess(model_dir, "--api-key", KEY_A, "--api-key", KEY_B,
                            "--max-model-len", str(MAX_MODEL_LEN))
    yield running
    running.stop()


def _candidate(rng: random.Random) -> str:
    """A text of ~25k characters (tens of ms to tokenize), unique to this call."""
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(400)]
    return " ".join(rng.choice(words) for _ in range(4000))[:25_000]


def _probe(client: httpx.Client, key: str, text: str) -> float:
    """Seconds until the refusal: the prompt tokenizes, then prompt + max_tokens is too long."""
    start = time.perf_counter()
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                    json={"prompt": text, "max_tokens": MAX_MODEL_LEN})
    took_s = time.perf_counter() - start
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    return took_s


def test_tenant_b_timing_does_not_depend_on_what_a_sent(engine: EngineProcess) -> None:
    rng = random.Random(2111)
    sent_s: list[float] = []
    fresh_s: list[float] = []
    own_hit_s: list[float] = []
    with httpx.Client(base_url=engine.url, timeout=60) as client:
        for _ in range(3):  # warm the connection and the code paths
            _probe(client, KEY_B, _candidate(rng))
        for i in range(NUM_PAIRS):
            sent, fresh = _candidate(rng), _candidate(rng)
            _probe(client, KEY_A, sent)  # tenant A's request with the secret text
            pair = [(sent, sent_s), (fresh, fresh_s)]
            for text, times in pair if i % 2 else pair[::-1]:
                times.append(_probe(client, KEY_B, text))
            own_hit_s.append(_probe(client, KEY_B, fresh))  # B's own earlier text: a hit
    # Paired differences (each pair measured back to back) cancel the machine's load drifts.
    leak_s = statistics.median(f - s for f, s in zip(fresh_s, sent_s, strict=True))
    hit_s = statistics.median(f - o for f, o in zip(fresh_s, own_hit_s, strict=True))
    figures = (f"B's p50: {statistics.median(sent_s) * 1e3:.2f} ms when A sent the text, "
               f"{statistics.median(fresh_s) * 1e3:.2f} ms when nobody did, "
               f"{statistics.median(own_hit_s) * 1e3:.2f} ms for its own earlier text; paired: "
               f"A's texts {leak_s * 1e3:.2f} ms faster, B's own {hit_s * 1e3:.2f} ms faster")
    print(figures)
    # The probe sees a hit: B's own cached text is clearly faster than a fresh one (on a loaded
    # 2-core host the fixed cost of a request grows, so the hit is a smaller share of it).
    assert hit_s > 0.1 * statistics.median(fresh_s), "no cache effect to detect: " + figures
    # What A sent makes no such difference for B.
    assert abs(leak_s) < 0.3 * hit_s, figures
    # A threshold halfway between hit and miss calls A's texts hits no more often than chance.
    threshold = (statistics.median(fresh_s) + statistics.median(own_hit_s)) / 2
    guessed_sent = sum(t < threshold for t in sent_s)
    assert guessed_sent <= 0.75 * len(sent_s), figures + f"; {guessed_sent} of {len(sent_s)}"
