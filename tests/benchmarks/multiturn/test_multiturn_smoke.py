"""benchmarks.multiturn.load end to end on CPU: real `kvengine serve` (and `kvstore serve`)
processes, 2 users x 3 rounds through each chat client (raw HTTP and the OpenAI SDK), the JSON
it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_helpers import start_daemon

from benchmarks.multiturn import load

pytestmark = pytest.mark.timeout(60)

WORKLOAD = ["--users", "2", "--rounds", "3", "--qps", "50", "--system-prompt-len", "64",
            "--history-len", "96", "--question-len", "12", "--answer-len", "6", "--seed", "3",
            "--request-timeout", "30", "--no-progress"]


def _run(url: str, out: Path, *extra: str) -> dict:
    assert load.main(["--url", url, *WORKLOAD, *extra, "--output", str(out)]) == 0
    return json.loads(out.read_text())


def _check_run(result: dict) -> list[dict]:
    records = result["records"]
    assert len(records) == 6
    assert all(r["error"] is None for r in records), [r["error"] for r in records]
    assert sorted((r["user"], r["round"]) for r in records) == [(u, k) for u in range(2)
                                                                for k in range(3)]
    for r in records:
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] == 6  # ignore_eos reached it
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        # One gap per content chunk after the first (a chunk may carry several tokens).
        assert 1 <= r["num_chunks"] <= 6 and len(r["itl_s"]) == r["num_chunks"] - 1
        assert sum(r["cached_tokens_by_tier"].values()) == r["cached_tokens"]
    for user in range(2):
        mine = sorted((r for r in records if r["user"] == user), key=lambda r: r["round"])
        assert [r["prompt_tokens"] for r in mine] == sorted(r["prompt_tokens"] for r in mine)
        assert mine[0]["prompt_tokens"] < mine[1]["prompt_tokens"]  # the history grew
        assert all(r["cached_tokens"] > 0 for r in mine[1:])  # later rounds hit the cache
    summary = result["summary"]
    assert summary["num_ok"] == 6 and summary["ttft_ms"]["p50"] > 0
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2]
    assert summary["rounds"][2]["hit_rate"] > summary["rounds"][0]["hit_rate"]
    assert result["config"]["workload"]["num_users"] == 2 and result["config"]["model"]
    assert {"machine", "date", "command"} <= result.keys()
    return records


@pytest.mark.parametrize("client", ["http", "openai"])
def test_multiturn_against_a_real_server(tiny_model_dir: Path, make_engine, tmp_path: Path,
                                         client: str) -> None:
    engine = make_engine(tiny_model_dir, "--served-model-name", "tiny-bench")
    result = _run(engine.url, tmp_path / "run.json", "--client", client)
    _check_run(result)
    assert result["config"]["model"] == "tiny-bench"  # found through /v1/models
    assert result["config"]["client"] == client


def test_the_http_client_records_a_refused_request(tiny_model_dir: Path, make_engine,
                                                   tmp_path: Path) -> None:
    """A 4xx answer is each request's recorded error, with the server's message."""
    engine = make_engine(tiny_model_dir)
    out = tmp_path / "run.json"
    code = load.main(["--url", engine.url, "--model", "no-such-model", *WORKLOAD,
                      "--output", str(out)])
    assert code == 1
    records = json.loads(out.read_text())["records"]
    assert len(records) == 6
    assert all(r["error"].startswith("RuntimeError: HTTP 404") for r in records), records
    assert all("no-such-model" in r["error"] for r in records)


def test_multiturn_with_kv_offload(tiny_model_dir: Path, make_engine, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, http=False)
    try:
        engine = make_engine(tiny_model_dir, "--kv-offload", "--kv-store-socket",
                             str(daemon.socket_path))
        records = _check_run(_run(engine.url + "/v1", tmp_path / "run.json", "--agentic",
                                  "--tool-result-len", "48"))
        assert all(r["prompt_tokens"] > 100 for r in records[1:])
        with daemon.client() as c:
            assert c.stats()["tiers"]["dram"]["blocks"] > 0  # the engine saved through the store
    finally:
        daemon.stop()


def test_a_dead_endpoint_is_recorded_not_raised(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    code = load.main(["--url", "http://127.0.0.1:9", "--model", "m", "--users", "1",
                     "--rounds", "2", "--qps", "100", "--request-timeout", "5",
                     "--no-progress", "--output", str(out)])
    assert code == 1  # nothing succeeded
    records = json.loads(out.read_text())["records"]
    assert len(records) == 2 and all(r["error"] for r in records)
