"""The distributions people install: wheel and sdist build offline, pass `twine check --strict`, ship the
PEP 561 markers and the license text that pyproject.toml declares."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TYPED_PACKAGES = ("safe_engine", "langchain_safe", "llamaindex_safe", "llama_index/llms/safe")


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheel, sdist), the wheel built from the sdist as pip would. `--no-isolation` uses the hatchling
    installed with the test extra, so no network is needed."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def test_twine_check_strict_passes(dists: tuple[Path, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_ships_py_typed_and_license(dists: tuple[Path, Path]) -> None:
    wheel, _ = dists
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for package in TYPED_PACKAGES:
            assert f"{package}/py.typed" in names, package
        (dist_info,) = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
        assert f"{dist_info}/licenses/LICENSE" in names  # metadata 2.4 (PEP 639) keeps license files here
        assert zf.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    assert "Classifier: Typing :: Typed" in metadata.splitlines()


def test_sdist_ships_license_and_py_typed(dists: tuple[Path, Path]) -> None:
    _, sdist = dists
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"LICENSE", "PKG-INFO", "pyproject.toml", "README.md"} <= names
    for package in TYPED_PACKAGES:
        assert f"{package}/py.typed" in names, package
    assert not any(n.startswith((".mypy_cache/", ".venv/")) for n in names)


def test_declared_license_matches_license_file() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert "License :: OSI Approved :: Apache Software License" in project["classifiers"]
