"""benchmarks.vllm_store.transfer on CPU tensors (the staged path) for a few blocks: every save and
load goes through a real daemon and the JSON has a row per block count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.vllm_store import transfer

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("torch")


def test_vllm_transfer_smoke(tmp_path: Path) -> None:
    assert transfer.main(["--device", "cpu", "--blocks", "4,16", "--reps", "1",
                         "--layers", "2", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("vllm_transfer-cpu-*.json")
    result = json.loads(path.read_text())
    assert [r["blocks"] for r in result["rows"]] == [4, 16]
    assert all(r["save_gbps"] > 0 and r["load_gbps"] > 0 for r in result["rows"])
    assert result["path"] == "staged through shared memory"
    assert result["command"].startswith("python -m benchmarks.vllm_store.transfer --device cpu")


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_save_request_size_is_refused_before_any_work(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        transfer.main(["--device", "cpu", "--save-request-blocks", value])
    assert exc.value.code == 2
    assert "--save-request-blocks" in capsys.readouterr().err
