"""Our top-level `kernels` package, and Hugging Face's `kernels` wheel of the same name.

Checked with pip on 2026-11-25 (kernels 0.17.2 and a kvstore-tiered wheel in a fresh venv): pip
installs both into one `site-packages/kernels/` without a warning; the later `__init__.py` wins
(so either our `kernels.make_ops` or HF's `kernels` breaks), and uninstalling one deletes the
shared `__init__.py` under the other. kvengine therefore refuses to start beside it.
"""

from __future__ import annotations

from pathlib import Path

from support.kvengine import run_kvengine

from server.package_check import OUR_DISTRIBUTION, foreign_kernels_owners

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kernels_imports_as_ours() -> None:
    import kernels

    assert Path(kernels.__file__).resolve().parent == REPO_ROOT / "kernels"
    ops = kernels.make_ops("cpu")
    assert ops.kv_dtype == "float32" and (REPO_ROOT / "kernels" / "KERNELS.md").is_file()
    assert foreign_kernels_owners() == []  # this environment has no second `kernels`


def _fake_hf_kernels(site: Path) -> Path:
    """A dist-info as pip leaves it for HF's `kernels` (metadata, RECORD), with its package."""
    info = site / "kernels-0.17.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.17.2\n")
    (info / "RECORD").write_text("kernels/__init__.py,,\nkernels/_rust.abi3.so,,\n"
                                 "kernels-0.17.2.dist-info/METADATA,,\n")
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text("")
    return site


def test_a_second_kernels_distribution_is_found(tmp_path: Path) -> None:
    site = _fake_hf_kernels(tmp_path / "site")
    assert foreign_kernels_owners([str(site)]) == ["kernels"]
    ours = tmp_path / "ours" / "kvstore_tiered-0.1.0.dist-info"
    ours.mkdir(parents=True)
    (ours / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {OUR_DISTRIBUTION}\n"
                                   "Version: 0.1.0\n")
    (ours / "top_level.txt").write_text("kernels\nkvstore\n")
    (tmp_path / "ours" / "kernels").mkdir()
    assert foreign_kernels_owners([str(tmp_path / "ours")]) == []
    # metadata alone, with no `kernels` folder beside it, is not searched (nothing to clash)
    bare = _fake_hf_kernels(tmp_path / "bare")
    for file in (bare / "kernels").iterdir():
        file.unlink()
    (bare / "kernels").rmdir()
    assert foreign_kernels_owners([str(bare)]) == []
    assert foreign_kernels_owners([str(bare), str(site)]) == ["kernels"]


def test_kvengine_refuses_to_start_beside_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    site = _fake_hf_kernels(tmp_path / "site")
    out = run_kvengine(["serve", str(tiny_model_dir), "--device", "cpu", "--port", "0"],
                       env={"PYTHONPATH": f"{site}:{REPO_ROOT}"})
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip uninstall kernels" in lines[0], out.stderr
