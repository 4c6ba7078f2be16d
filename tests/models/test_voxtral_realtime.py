"""Realtime embeddings (issue 42): Voxtral Realtime, whose every step, prompt and decode, adds the audio
encoder's row of its position to the token's embedding (``MultiModalInput.additive``), through the
Transformers backend with our prompt (``multimodal_voxtral_realtime``: ``transformers``' processor needs
``mistral_common``). A tiny random Voxtral Realtime (a 2-layer causal audio encoder with a sliding window
of 24 rows, its rows regrouped 4 to 1; a 2-layer Mistral with SmolLM2's vocabulary plus
``[STREAMING_PAD]``) gives ``transformers``' greedy tokens and top-5 logprobs (float32, its own
``generate``, which runs the encoder step by step with its caches) for two clips batched with a text-free
request of another length: whole, chunked and preempted; generation ends with the audio; the clip's rows
stay in the encoder cache until the request ends and nothing leaks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.models.test_qwen2_audio import RATE, clip

GREEDY = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, logprobs=5)
PAD = "[STREAMING_PAD]"
LEFT, DELAY, BUFFER, PER_TOKEN = 32, 6, 10, 1280  # frames, frames, frames, samples per frame (80 ms)


@pytest.fixture(scope="module")
def realtime(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, tokenizer, feature extractor)`` of the tiny random model."""
    from transformers import AutoTokenizer, VoxtralRealtimeConfig, VoxtralRealtimeForConditionalGeneration
    from transformers.models.voxtral_realtime.feature_extraction_voxtral_realtime import (
        VoxtralRealtimeFeatureExtractor)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": [PAD]})
    cfg = VoxtralRealtimeConfig(
        audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          head_dim=8, num_mel_bins=128, sliding_window=24, max_position_embeddings=1500),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=48,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, initializer_range=0.2),
        default_num_delay_tokens=DELAY)
    torch.manual_seed(0)
    model = VoxtralRealtimeForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("voxtral-realtime") / "tiny-voxtral-realtime"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    fe = VoxtralRealtimeFeatureExtractor()
    fe.save_pretrained(out)
    return out, model, tok, fe


CLIPS = [clip(1.0, 440, 1), clip(2.3, 300, 2)]


def reference(realtime, greedy_ref, wave: np.ndarray):
    """``transformers``' greedy tokens and logits of one clip, padded by mistral_common's documented rule
    (32 frames of silence on the left; to a whole frame, then delay + BOS + 10 frames on the right), the
    prompt BOS + 38 streaming pads, and as many new tokens as the audio has frames left."""
    _, model, tok, fe = realtime
    right = (-len(wave)) % PER_TOKEN + PER_TOKEN * (DELAY + 1 + BUFFER)
    feats = fe(np.pad(wave, (LEFT * PER_TOKEN, right)), sampling_rate=RATE, return_tensors="pt")["input_features"]
    prompt = [1] + [tok.convert_tokens_to_ids(PAD)] * (LEFT + DELAY)
    frames = feats.shape[-1] // 8
    return greedy_ref.hf_greedy(model, prompt, frames - len(prompt), input_features=feats, num_delay_tokens=DELAY)


@pytest.mark.parametrize("budget,blocks", [(4096, 256), (16, 256), (4096, 30)])
def test_realtime_gives_transformers_tokens(realtime, greedy_ref, assert_no_leaks, budget, blocks):
    """Two clips batched (1 s: 62 frames; 2.3 s: 78), whole; with a budget of 16 tokens (the prompt of 39 in
    chunks); with 30 blocks of 4 for sequences of 62 and 78 (preemption: the clip is encoded again)."""
    llm = LLM(str(realtime[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([{"prompt": "", "multi_modal_data": {"audio": (c, RATE)}} for c in CLIPS], GREEDY,
                        use_tqdm=False)
    for wave, out in zip(CLIPS, outs):
        ids, logits = reference(realtime, greedy_ref, wave)
        what = f"a clip of {len(wave) / RATE} s"
        assert len(out.outputs[0].token_ids) == len(ids) and out.outputs[0].finish_reason == "length", what
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, what)
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, what)
    core = llm.engine.core
    if blocks == 30:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_realtime_prompt_and_refusals(realtime):
    """The processor's prompt and frames; text, no clip or two clips are refused naming the field."""
    from pagedllm.multimodal_voxtral_realtime import VoxtralRealtimeAudioProcessor
    proc = VoxtralRealtimeAudioProcessor(realtime[0])
    out = proc("", audio=[CLIPS[0]])
    assert out["input_ids"].shape == (1, 1 + LEFT + DELAY) and out["realtime_tokens"].tolist() == [LEFT + 13 + 17]
    assert out["input_features"].shape == (1, 128, 8 * (LEFT + 13 + 17))
    llm = LLM(str(realtime[0]), num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="prompt: this model transcribes audio"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data: .*empty prompt"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": (CLIPS[0], RATE)}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data: .*one audio clip per request, got 2"):
        llm.generate({"prompt": "", "multi_modal_data": {"audio": [(c, RATE) for c in CLIPS]}}, GREEDY,
                     use_tqdm=False)


def test_stream_segments_encode_as_the_whole_clip(realtime):
    """A realtime stream's segments (``RealtimeStream``: 0.3 s pieces, a request at each whole block of 16
    rows, then the rest at the commit) through the model's streaming encoder equal the whole clip's rows,
    continued from the kept caches and rebuilt from the earlier segments when they are gone."""
    from pagedllm.multimodal_voxtral_realtime import RealtimeStream, VoxtralRealtimeAudioProcessor
    proc = VoxtralRealtimeAudioProcessor(realtime[0])
    llm = LLM(str(realtime[0]), num_kv_blocks=64, block_size=16)
    model = llm.llm_engine.runner.model
    wave = clip(3.0, 500, 7)
    stream, segments = RealtimeStream(proc, 16), []
    for i in range(0, wave.size, RATE * 3 // 10):
        stream.append(wave[i:i + RATE * 3 // 10])
        prompt = stream.next_request(False)
        if prompt is not None:
            segments = list(prompt.inputs)
            stream.took([0] * (segments[-1].end + 1 - len(prompt.ids)))  # as the request would write
    segments = list(stream.next_request(True).inputs)
    assert [m.offset for m in segments] == [0, 48, 64] and segments[-1].end == 32 + 38 + 17
    assert [m.open for m in segments] == [True, True, False] and len({m.hash for m in segments}) == 3
    whole = torch.from_numpy(proc("", audio=[wave])["input_features"])
    want = model.encode_realtime_audio(whole, torch.tensor([segments[-1].end]))
    got = torch.cat([model.encode_stream(m, segments[:k]) for k, m in enumerate(segments)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not model._streams  # the last segment closed the stream
    model.encode_stream(segments[0], [])
    again = model.encode_stream(segments[2], segments[:2])  # kept at row 48, asked for 64: rebuilt
    torch.testing.assert_close(again, want[64:], rtol=1e-4, atol=1e-5)
