"""`kvengine serve ORG/NAME`: a Hugging Face repo id served from the local hub cache, offline;
a missing one is a one-line error naming the cache and HF_HUB_OFFLINE."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
from support.kvengine import KvengineProcess, run_kvengine

from server.model_source import looks_like_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hf_home: Path, repo_id: str, model_dir: Path) -> Path:
    """`model_dir`'s files as huggingface_hub caches a download of `repo_id`: content-addressed
    blobs, a snapshot folder of relative symlinks to them, refs/main naming the commit."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        os.symlink(Path("..") / ".." / "blobs" / digest, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo


def test_a_cached_repo_id_serves_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    from huggingface_hub import scan_cache_dir

    hf_home = tmp_path / "hf"
    fake_hub_cache(hf_home, "kvtest/tiny-model", tiny_model_dir)
    # The layout is huggingface_hub's own: its cache scanner sees the repo, revision and files.
    (repo,) = scan_cache_dir(hf_home / "hub").repos
    assert repo.repo_id == "kvtest/tiny-model"
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and "config.json" in {f.file_name for f in
                                                                 revision.files}
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    with KvengineProcess("kvtest/tiny-model", env=env) as served:
        models = httpx.get(served.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "kvtest/tiny-model"  # the repo id, as in vLLM
        r = httpx.post(served.url + "/v1/completions", timeout=60,
                       json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_missing_repo_id_is_one_line(tmp_path: Path) -> None:
    hf_home = tmp_path / "empty-hf"
    out = run_kvengine(["serve", "kvtest/not-there", "--device", "cpu", "--port", "0"],
                       env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert str(hf_home / "hub") in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert "kvtest/not-there" in lines[0]


def test_what_counts_as_a_repo_id() -> None:
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and looks_like_hub_id("gpt2")
    for name in ("/abs/path", "./rel", "a/b/c", "../up", "has space/x", ""):
        assert not looks_like_hub_id(name), name
