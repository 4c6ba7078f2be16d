"""PaliGemma (issue 41): a prefix-LM, whose whole prompt (image tokens, then the text) attends both
ways and whose generated tokens attend causally (transformers' ``token_type_ids`` 0 for the prompt).
The prompt is one span (the last image's input extended to the prompt's end): computed in one step,
passed to attention whole, and its hash, which takes every prompt token, in every prompt block, so a
prefix hit needs the same image and the same whole prompt. A tiny random PaliGemma (a SigLIP tower at
32 px, 16 placeholders, before a 2-layer Gemma with SmolLM2's vocabulary) through the Transformers
backend gives ``transformers``' top-5 logprobs (float32) within 1e-3; with a causal prompt they move by
more than 0.1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)


def _image(seed: int, size=(40, 50)):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, processor)`` of the tiny random PaliGemma."""
    from transformers import (AutoTokenizer, GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration,
                              PaliGemmaProcessor, SiglipImageProcessorPil, SiglipVisionConfig)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    init = 0.2  # large enough that the prompt's two-way attention moves the logits
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=8, projection_dim=64, initializer_range=init)
    text = GemmaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=init,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                          projection_dim=64)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("paligemma") / "tiny-paligemma"
    model.save_pretrained(out)
    proc = PaliGemmaProcessor(image_processor=SiglipImageProcessorPil(size={"height": 32, "width": 32},
                                                                      image_seq_length=16), tokenizer=tok)
    proc.save_pretrained(out)
    return out, model, proc


PROMPTS = [("<image>caption en", [_image(0)]), ("<image>answer en where is the cow standing?", [_image(1)])]


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}}


def _reference(paligemma, greedy_ref, text, images):
    _, model, proc = paligemma
    inp = proc(text=text, images=images, return_tensors="pt")
    return greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, pixel_values=inp["pixel_values"],
                                token_type_ids=inp["token_type_ids"])


def test_the_prefix_masks_matter(paligemma):
    """transformers' PaliGemma with its prompt causal instead (its bidirectional flag off) moves the
    next token's logprobs by far more than the tests' tolerance: the checks below have teeth."""
    _, model, proc = paligemma
    inp = proc(text=PROMPTS[1][0], images=PROMPTS[1][1], return_tensors="pt")
    attn = [layer.self_attn for layer in model.model.language_model.layers]
    with torch.no_grad():
        two_way = model(**inp).logits[0, -1].log_softmax(-1)
        model.config.text_config.use_bidirectional_attention = False
        for a in attn:
            a.is_causal = True
        try:
            causal = model(input_ids=inp["input_ids"], pixel_values=inp["pixel_values"]).logits[0, -1].log_softmax(-1)
        finally:
            model.config.text_config.use_bidirectional_attention = True
            for a in attn:
                a.is_causal = False
    assert (two_way - causal).abs().max() > 0.1


@pytest.mark.parametrize("budget", [2048, 24])
def test_paligemma_prompt_attends_both_ways(paligemma, greedy_ref, assert_no_leaks, budget):
    """Whole prompts, and a budget of 24 tokens (each prompt, 21-30 tokens, waits for a step that takes
    it whole, the longer one refused naming the budget); transformers' logprobs with the prefix-LM masks."""
    llm = LLM(str(paligemma[0]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=budget)
    if budget < 30:
        with pytest.raises(ValueError, match="max-num-batched-tokens"):
            llm.generate([_request(*PROMPTS[1])], GREEDY, use_tqdm=False)
    prompts = PROMPTS if budget >= 30 else PROMPTS[:1]
    outs = llm.generate([_request(t, i) for t, i in prompts], GREEDY, use_tqdm=False)
    for (text, images), out in zip(prompts, outs):
        ids, logits = _reference(paligemma, greedy_ref, text, images)
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, text)
    assert_no_leaks(llm.engine)


def test_a_prefix_hit_needs_the_whole_prompt(paligemma, greedy_ref, assert_no_leaks):
    """The same image and prompt hit the cache (and give the same logprobs); the same image with a
    longer prompt reuses nothing: its first blocks' K/V depend on its later text."""
    llm = LLM(str(paligemma[0]), num_kv_blocks=64, block_size=4)
    text, images = PROMPTS[1]
    llm.generate([_request(text, images)], GREEDY, use_tqdm=False)
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = llm.generate([_request(text, images)], GREEDY, use_tqdm=False)[0]
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits >= 24
    ids, logits = _reference(paligemma, greedy_ref, text, images)
    greedy_ref.assert_logprobs(again.outputs[0], ids, logits, "prefix hit")
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    longer = llm.generate([_request(text + " And the sky?", images)], GREEDY, use_tqdm=False)[0]
    assert llm.llm_engine.get_stats().prefix_cache_hits == hits
    ids, logits = _reference(paligemma, greedy_ref, text + " And the sky?", images)
    greedy_ref.assert_logprobs(longer.outputs[0], ids, logits, "longer prompt")
    assert_no_leaks(llm.engine)
