"""benchmarks/store.py's save part against a real daemon: every save lands, the figures are
filled in, and --parts refuses what it does not know."""

from __future__ import annotations

import pytest

from benchmarks import store as store_bench


def test_the_save_part_times_saves_that_landed() -> None:
    rows = store_bench.bench_shm_save(4096, (1, 8), reps=3)
    assert [r["blocks"] for r in rows] == [1, 8]
    for row in rows:  # bench_shm_save asserts each save's num_saved itself
        assert row["save_p50_ms"] > 0 and row["raw_copy_p50_ms"] > 0
        assert row["save_us_per_block"] == pytest.approx(row["save_p50_ms"] * 1e3
                                                         / row["blocks"])


def test_unknown_parts_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        store_bench.main(["--parts", "save,disk"])
    assert exit_info.value.code == 2
    assert "--parts" in capsys.readouterr().err
