"""Audio in (issue 42): Voxtral (a Whisper-style audio encoder, a projector over groups of its rows, and a
Llama language model) through the Transformers backend, with our own expansion of its ``[AUDIO]``
placeholder (``multimodal_voxtral``: ``transformers``' ``VoxtralProcessor`` needs ``mistral_common``).
A tiny random Voxtral (2 encoder layers of width 32 whose rows regroup 4 to 1, as Voxtral Mini's:
375 placeholders per 30 s chunk; SmolLM2's vocabulary plus ``[AUDIO]``) gives ``transformers``' greedy
tokens and top-5 logprobs (float32) for one clip, two clips and a 35 s clip (two chunks), whole,
chunked through a clip and preempted; the reference takes ``transformers``' own Voxtral features
(``VoxtralProcessor._retrieve_input_features``) and the prompt expanded by text. A chat ``input_audio``
part gives the same; an image, too many clips and a text whose placeholders are not one per clip are
refused naming the field.
"""

from __future__ import annotations

import base64
import io
import types
import wave

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.models.test_qwen2_audio import RATE, clip

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
AUDIO = "[AUDIO]"
CHUNK_TOKENS = 375  # 1500 encoder rows of width 32 regrouped to the projector's 128


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, tokenizer, feature extractor)`` of the tiny random Voxtral."""
    from transformers import AutoTokenizer, VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": [AUDIO]})
    cfg = VoxtralConfig(
        audio_config=dict(model_type="voxtral_encoder", d_model=32, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=128, num_mel_bins=128, max_source_positions=1500),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2),
        audio_token_id=tok.convert_tokens_to_ids(AUDIO))
    torch.manual_seed(0)
    model = VoxtralForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("voxtral") / "tiny-voxtral"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    fe = WhisperFeatureExtractor(feature_size=128)
    fe.save_pretrained(out)
    return out, model, tok, fe


PROMPTS = [(f"Listen: {AUDIO} What is it?", [clip(1.5, 440)]),
           (f"Compare {AUDIO} with {AUDIO}: which is higher?", [clip(1.0, 300, 1), clip(0.7, 600, 2)]),
           (f"Summarise {AUDIO} please.", [clip(35.0, 250, 3)]),
           ("Tell me about the printing press.", [])]


def _request(text, clips):
    return {"prompt": text, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}} if clips else text


def reference(voxtral, greedy_ref, text, clips, add_special_tokens=True):
    """``transformers``' greedy tokens and logits: its Voxtral processor's features of ``clips`` (30 s
    chunks) and the prompt with each ``[AUDIO]`` written 375 times per chunk of its clip."""
    from transformers.models.voxtral.processing_voxtral import VoxtralProcessor
    _, model, tok, fe = voxtral
    if not clips:
        return greedy_ref.hf_greedy(model, tok(text)["input_ids"], MAX_NEW)
    feats = VoxtralProcessor._retrieve_input_features(
        types.SimpleNamespace(feature_extractor=fe), clips, 3000, sampling_rate=RATE, padding=True, truncation=False,
        pad_to_multiple_of=480000, return_tensors="pt")
    parts = text.split(AUDIO)
    chunks = [-(-len(c) // 480000) for c in clips]
    expanded = parts[0] + "".join(AUDIO * (CHUNK_TOKENS * k) + p for k, p in zip(chunks, parts[1:]))
    ids = tok(expanded, add_special_tokens=add_special_tokens)["input_ids"]
    assert ids.count(model.config.audio_token_id) == CHUNK_TOKENS * sum(chunks) == len(feats) * CHUNK_TOKENS
    return greedy_ref.hf_greedy(model, ids, MAX_NEW, input_features=feats)


@pytest.mark.parametrize("budget,blocks", [(4096, 640), (64, 640), (4096, 480)])
def test_voxtral_gives_transformers_tokens(voxtral, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 64 tokens (chunks end inside a clip's 375-750 placeholders); 480 blocks
    of 4 for prompts of 7-759 tokens (477 blocks) and their output (preemption: the clips are encoded
    again)."""
    llm = LLM(str(voxtral[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(t, c) for t, c in PROMPTS], GREEDY, use_tqdm=False)
    for (text, clips), out in zip(PROMPTS, outs):
        ids, logits = reference(voxtral, greedy_ref, text, clips)
        what = f"{len(clips)} clips of {[len(c) / RATE for c in clips]} s"
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, what)
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, what)
    core = llm.engine.core
    if blocks == 480:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_expansion_is_375_placeholders_per_30_s_chunk(voxtral):
    """A 35 s clip is two chunks of 3000 frames: 750 placeholders where the prompt wrote one."""
    from pagedllm.multimodal_voxtral import VoxtralAudioProcessor
    proc = VoxtralAudioProcessor(voxtral[0])
    out = proc(f"a {AUDIO} b {AUDIO}", audio=[clip(35.0, 250), clip(0.5, 440)])
    assert proc.chunk_tokens == CHUNK_TOKENS and out["audio_chunks"].tolist() == [2, 1]
    assert out["input_features"].shape == (3, 128, 3000)
    assert (out["input_ids"][0] == voxtral[1].config.audio_token_id).sum() == 3 * CHUNK_TOKENS
    with pytest.raises(ValueError, match="1 \\[AUDIO\\] tokens for 2 clips"):
        proc(f"a {AUDIO}", audio=[clip(0.5, 440), clip(0.5, 440)])


def _wav_b64(samples: np.ndarray) -> str:
    """Base64 of a 16-bit mono 16 kHz WAV file of ``samples``."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def test_chat_input_audio_gives_transformers_answer(voxtral, greedy_ref):
    """A chat ``input_audio`` part is the clip at the placeholder (``LLM.chat``, the chat API's parser)."""
    from pagedllm.media import audio_from_base64
    data = _wav_b64(clip(1.0, 440))
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                             {"type": "text", "text": "What do you hear?"}]}]
    llm = LLM(str(voxtral[0]), num_kv_blocks=128, block_size=4)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    text = voxtral[2].apply_chat_template([{"role": "user", "content": f"{AUDIO}\nWhat do you hear?"}],
                                          tokenize=False, add_generation_prompt=True)
    ids, _ = reference(voxtral, greedy_ref, text, [audio_from_base64(data, "clip", RATE)], False)
    assert list(out[0].outputs[0].token_ids) == ids


def test_voxtral_refuses_images_and_extra_clips(voxtral):
    """An image, more clips than ``--limit-mm-per-prompt`` and placeholders not one per clip: each a
    ``SamplingParamError`` naming the field."""
    from PIL import Image

    from pagedllm.sampling_params import SamplingParamError
    llm = LLM(str(voxtral[0]), num_kv_blocks=64, block_size=4, limit_mm_per_prompt={"audio": 1})
    with pytest.raises(SamplingParamError, match="multi_modal_data.image: this model takes no image"):
        llm.generate({"prompt": "what?", "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, use_tqdm=False)
    with pytest.raises(SamplingParamError, match="multi_modal_data: 2 audio clips, more than --limit-mm-per-prompt"):
        llm.generate(_request(f"{AUDIO}{AUDIO}", [clip(0.5, 440), clip(0.5, 300)]), use_tqdm=False)
    with pytest.raises(SamplingParamError, match="multi_modal_data: the text has 0 \\[AUDIO\\] tokens for 1 clips"):
        llm.generate(_request("no placeholder", [clip(0.5, 440)]), use_tqdm=False)


def test_processor_kwargs_are_refused_for_voxtral(voxtral):
    """Our Voxtral expansion has no settings: ``--mm-processor-kwargs`` is refused, never ignored."""
    with pytest.raises(ValueError, match="--mm-processor-kwargs"):
        LLM(str(voxtral[0]), num_kv_blocks=64, block_size=4, mm_processor_kwargs={"chunk_frames": 10})
