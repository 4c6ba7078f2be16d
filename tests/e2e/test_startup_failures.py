"""``pagedllm serve`` on broken model files: it exits non-zero with one clear line naming the file,
no traceback, and leaves no ipc socket files behind."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pagedllm.models.loader import default_model_path
from pagedllm.models.resolve import resolve_model


def _sockets() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pagedllm-*")))


def _broken_models(root: Path) -> dict[str, tuple[Path, Path]]:
    """name -> (model argument, the file its error must name)."""
    good = resolve_model(None)  # the converted default (cached after its first use)
    out = {}
    trunc = root / "truncated-safetensors"
    trunc.mkdir()
    for f in good.iterdir():
        if f.name != "model.safetensors":
            (trunc / f.name).symlink_to(f)
    with open(good / "model.safetensors", "rb") as src:
        (trunc / "model.safetensors").write_bytes(src.read(1_000_000))
    out["truncated_safetensors"] = (trunc, trunc / "model.safetensors")
    bad_config = root / "corrupt-config"
    bad_config.mkdir()
    for f in good.iterdir():
        if f.name != "config.json":
            (bad_config / f.name).symlink_to(f)
    (bad_config / "config.json").write_text('{"model_type": "llama", ')
    out["corrupt_config"] = (bad_config, bad_config / "config.json")
    gguf = Path(default_model_path())
    with open(gguf, "rb") as src:
        (root / "truncated.gguf").write_bytes(src.read(2_000_000))
    out["truncated_gguf"] = (root / "truncated.gguf", root / "truncated.gguf")
    (root / "random.gguf").write_bytes(os.urandom(100_000))
    out["random_gguf"] = (root / "random.gguf", root / "random.gguf")
    return out


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return _broken_models(tmp_path_factory.mktemp("broken"))


@pytest.mark.parametrize("case", ["truncated_safetensors", "corrupt_config", "truncated_gguf", "random_gguf"])
def test_broken_model_file_gives_one_line_naming_it(broken, case, tmp_path):
    model, culprit = broken[case]
    before = _sockets()
    env = {**os.environ, "PAGEDLLM_CACHE": str(tmp_path / "cache")}  # GGUF conversions go to a scratch cache
    from pagedllm.cache import cache_root
    (tmp_path / "cache").mkdir()  # but the built C kernels are shared: building them again took 90 s
    (cache_root() / "kernels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "kernels").symlink_to(cache_root() / "kernels", target_is_directory=True)
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", str(model), "--port", "0",
                        "--log-level", "warning"], capture_output=True, text=True, timeout=300, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("pagedllm: error: ") and str(culprit) in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    assert not (_sockets() - before)
