"""Issue 32 items 1 and 2: tokenizing stalled the whole HTTP server.

1. /tokenize encoded a 4 MB prompt (`add_special_tokens: false`, or a chat with specials) with
   the engine's encoder on a plain thread, holding the GIL, with no length check: 200 after
   4.5 s, every other client's /health blocked 4.1 s, RSS +450 MiB; token strings were built on
   the event loop. Now it takes /v1's path: the early check on characters, the bounded pool.
2. A `prompt` list of hundreds of short strings was encoded string by string on the event loop
   (each small enough to stay inline), with nothing bounding the request's total: /health
   blocked 1.8 s. Now the total is checked on characters first and a batch is tokenized as one
   job of the bounded pool.

A real `kvengine serve` on the tiny CPU model (2,048-token context); another client polls
/health with fresh connections throughout and must never wait 0.25 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from engine_process import EngineProcess, post_all_while_watching, tiny_model

pytestmark = pytest.mark.timeout(180)

HEALTH_BOUND_S = 0.25  # the bound on another client's /health meanwhile
BIG_PROMPT = "lorem ipsum dolor sit amet " * (3_900_000 // 27)  # 3.9 MB: under the body limit
SENTENCE = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    running = EngineProcess(tiny_model(tmp_path_factory.mktemp("tokenize-stall") / "tiny"))
    yield running
    running.stop()


def test_a_4_mb_prompt_to_tokenize_is_refused_early(engine: EngineProcess) -> None:
    """Item 1: the three ways in that skipped the check, at once."""
    bodies = [
        {"prompt": BIG_PROMPT, "add_special_tokens": False},
        {"prompt": BIG_PROMPT, "add_special_tokens": False, "return_token_strs": True},
        {"messages": [{"role": "user", "content": BIG_PROMPT}], "add_special_tokens": True},
    ]
    rss_before = engine.rss_bytes()
    responses, took_s, watch = post_all_while_watching(engine.url, "/tokenize", bodies)
    grown = engine.rss_bytes() - rss_before
    print(f"\n/tokenize x3 of 3.9 MB: {[r.status_code for r in responses]} in {took_s:.2f} s, "
          f"/health worst {watch.worst_s * 1000:.0f} ms, RSS +{grown >> 20} MiB")
    for response in responses:
        assert response.status_code == 400, response.text[:200]
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded", error
        assert "maximum context length is 2048 tokens" in error["message"], error
    assert watch.worst_s < HEALTH_BOUND_S, f"/health waited {watch.worst_s:.2f} s"
    assert grown < 96 << 20, f"RSS grew by {grown >> 20} MiB"
    # What fits is still tokenized, as the engine's tokenizer does it.
    from engine.tokenizer import Tokenizer

    text = SENTENCE * 20
    r = httpx.post(engine.url + "/tokenize", timeout=30, json={
        "prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert r.status_code == 200, r.text[:200]
    model_dir = engine.proc.args[engine.proc.args.index("--model") + 1]
    expected = Tokenizer(model_dir).encode(text, add_special_tokens=False)
    assert r.json()["tokens"] == expected and len(r.json()["token_strs"]) == len(expected)


def test_a_batch_of_short_prompts_is_bounded_and_tokenized_off_the_loop(
        engine: EngineProcess) -> None:
    """Item 2: (a) the issue's batch, 480 distinct strings each short enough to stay inline
    (1.9 MB), twice at once: refused from its total before tokenizing; (b) four batches under
    the total bound (200 strings, 0.8 MB each) at once: tokenized on the pool while /health
    answers. Each asks for more tokens than the context leaves, so a batch that gets through
    tokenizing is refused then, and the engine runs nothing."""
    text = SENTENCE * 90  # about 1,900 tokens: each prompt fits the context on its own
    big = [{"prompt": [f"{k} {i} {text}" for i in range(480)], "max_tokens": 2000}
           for k in range(2)]
    rss_before = engine.rss_bytes()
    big_responses, big_s, big_watch = post_all_while_watching(engine.url, "/v1/completions", big)
    grown = engine.rss_bytes() - rss_before
    under = [{"prompt": [f"under {k} {i} {text}" for i in range(200)], "max_tokens": 2000}
             for k in range(4)]
    under_responses, under_s, under_watch = post_all_while_watching(
        engine.url, "/v1/completions", under)
    print(f"\n2 x 480 prompts: {[r.status_code for r in big_responses]} in {big_s:.2f} s, "
          f"/health worst {big_watch.worst_s * 1000:.0f} ms, RSS +{grown >> 20} MiB; "
          f"4 x 200 prompts: {under_s:.2f} s, /health worst {under_watch.worst_s * 1000:.0f} ms")
    assert big_watch.worst_s < HEALTH_BOUND_S, f"/health waited {big_watch.worst_s:.2f} s"
    assert under_watch.worst_s < HEALTH_BOUND_S, f"/health waited {under_watch.worst_s:.2f} s"
    for response in big_responses:
        assert response.status_code == 413, response.text[:200]
        error = response.json()["error"]
        assert error["code"] == "request_too_large", error
        assert "may hold at most 65536 tokens together" in error["message"], error
    for response in under_responses:  # tokenized whole: the answer names the token count
        assert response.status_code == 400, response.text[:200]
        assert "in the prompt, 2000 to generate" in response.json()["error"]["message"]
    assert grown < 96 << 20, f"RSS grew by {grown >> 20} MiB"
