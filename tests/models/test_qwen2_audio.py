"""Audio in (issue 42, second part): Qwen2-Audio (a Whisper-style audio encoder and projector in front
of a Qwen2 language model) through the Transformers backend. A tiny random Qwen2-Audio (2 encoder
layers of width 32, SmolLM2's vocabulary plus ``<|audio_bos|>``, ``<|AUDIO|>``, ``<|audio_eos|>``) with
``transformers``' own ``Qwen2AudioProcessor`` (Whisper's log-mel features) gives ``transformers``'
greedy tokens and top-5 logprobs (float32) for one and two clips beside a text prompt, whole, chunked
through a clip and preempted; clips are read from vLLM's ``(samples, sampling_rate)`` pairs
(int16 and stereo too), and a clip for a model that takes none is refused naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
RATE = 16000


def clip(seconds: float, hz: float, seed: int = 0) -> np.ndarray:
    """``[seconds * 16000]`` float32: a tone with a little noise."""
    t = np.arange(int(RATE * seconds)) / RATE
    noise = np.random.default_rng(seed).standard_normal(t.shape) * 0.05
    return (0.3 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, processor)`` of the tiny random Qwen2-Audio."""
    from transformers import (AutoTokenizer, Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                              WhisperFeatureExtractor)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]})
    cfg = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=128,
                          max_source_positions=1500),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2),
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("qwen2_audio") / "tiny-qwen2-audio"
    model.save_pretrained(out)
    proc = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok)
    proc.save_pretrained(out)
    return out, model, proc


PROMPTS = [(f"Listen: {AUDIO} What is it?", [clip(1.5, 440)]),
           (f"Compare {AUDIO} with {AUDIO}: which is higher?", [clip(1.0, 300, 1), clip(0.7, 600, 2)]),
           ("Tell me about the printing press.", [])]


def _request(text, clips):
    return {"prompt": text, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}} if clips else text


def reference(qwen2_audio, greedy_ref, text, clips, add_special_tokens=True):
    """``transformers``' greedy tokens and logits on the processor's features of ``clips``."""
    _, model, proc = qwen2_audio
    inp = proc(text=text, audio=clips or None, sampling_rate=RATE, return_tensors="pt",
               add_special_tokens=add_special_tokens)
    extra = {k: inp[k] for k in ("input_features", "feature_attention_mask")} if clips else {}
    return greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, **extra)


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (8, 64), (2048, 30)])
def test_qwen2_audio_gives_transformers_tokens(qwen2_audio, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 8 tokens (chunks end inside a clip's 25-37 placeholders); 30 blocks of
    4 for prompts of 7-55 tokens (28 blocks) and their output (preemption: the clips are encoded again)."""
    llm = LLM(str(qwen2_audio[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(t, c) for t, c in PROMPTS], GREEDY, use_tqdm=False)
    for (text, clips), out in zip(PROMPTS, outs):
        ids, logits = reference(qwen2_audio, greedy_ref, text, clips)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(clips)} clips")
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, f"{len(clips)} clips")
    core = llm.engine.core
    if blocks == 30:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_clips_are_read_as_vllm_gives_them():
    """int16 stereo at 16 kHz is the float mean of its channels; 8 kHz is resampled to 16 kHz."""
    from pagedllm.multimodal_audio import read_clip
    mono = clip(0.5, 440)
    stereo = (np.stack([mono, mono], 1) * 32767).astype(np.int16)
    np.testing.assert_allclose(read_clip((stereo, RATE), RATE, "a"), mono, atol=1e-4)
    assert read_clip((mono[::2], RATE // 2), RATE, "a").shape[0] == pytest.approx(mono.shape[0], abs=32)
    with pytest.raises(ValueError, match="sampling rate"):
        read_clip((mono, 0), RATE, "a")


def test_audio_for_a_model_without_audio_is_refused(tiny_llava, qwen2_audio):
    """LLaVA takes no audio and Qwen2-Audio no image: each a ``SamplingParamError`` naming the field."""
    from PIL import Image

    from pagedllm.sampling_params import SamplingParamError
    llm = LLM(str(tiny_llava[0]), num_kv_blocks=16, block_size=4)
    with pytest.raises(SamplingParamError, match="takes no audio"):
        llm.generate(_request("USER: what?", [clip(0.5, 440)]), use_tqdm=False)
    llm = LLM(str(qwen2_audio[0]), num_kv_blocks=16, block_size=4)
    with pytest.raises(SamplingParamError, match="takes no image"):
        llm.generate({"prompt": "what?", "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, use_tqdm=False)
