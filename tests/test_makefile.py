"""The README's two commands: a second ``make serve`` / ``make test`` installs nothing when
nothing changed (issue 36: every ``make serve`` reran three ``pip install`` s, 17 s), and a fresh
venv or a newer ``pyproject.toml`` installs again."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _plan(target: str, venv: Path) -> str:
    return subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"], capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_second_serve_or_test_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert "pip install" in _plan("serve", venv)  # not installed yet
    future = time.time() + 60  # stamps newer than pyproject.toml and the Makefile
    for stamp in (".installed", ".installed-test"):
        (venv / stamp).touch()
        os.utime(venv / stamp, (future, future))
    assert "pip install" not in _plan("serve", venv)
    assert "pip install" not in _plan("test", venv)
    os.utime(venv / ".installed", (time.time() - 3600,) * 2)  # older than pyproject.toml: install again
    assert "pip install" in _plan("serve", venv)
