"""What the distribution carries besides code (issue 30 item 8): the license pyproject names, as a
LICENSE file; a py.typed marker in every package, shipped as package data; a CHANGELOG entry for
the version being built; the vLLM plugin entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "offload", "engine", "kernels", "server")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_file_is_the_license_pyproject_names() -> None:
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_every_package_is_marked_typed_and_ships_the_marker() -> None:
    assert [p for p in PACKAGES if not (ROOT / p / "py.typed").is_file()] == []
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["*"]


def test_the_changelog_has_the_version_being_built() -> None:
    version = PYPROJECT["project"]["version"]
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()


def test_vllm_finds_the_connector_through_the_plugin_entry_point() -> None:
    plugins = PYPROJECT["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"kvstore": "kvstore_tiered_vllm:register"}
    assert "kvstore_tiered_vllm" in PYPROJECT["tool"]["setuptools"]["py-modules"]
