"""LLaVA-NeXT (issue 41): images cut into a grid of patches picked by their size ("anyres"), so two
images of different shapes take different numbers of placeholder tokens and the processor pads their
``pixel_values`` to the most patches; the vision tower reads each image's ``image_sizes`` beside its
pixels (``multimodal_inputs.PER_IMAGE_KEYS``). A tiny random LLaVA-NeXT (a CLIP tower at 32 px, grids up to
2 x 2, a 2-layer Llama with SmolLM2's vocabulary) through the Transformers backend gives
``transformers``' greedy tokens (float32) for one and two images per prompt beside a text-only prompt,
whole, chunked through an image and preempted; the same image again hits the prefix cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
GRIDS = [[32, 64], [64, 32], [64, 64]]


def _image(seed: int, size=(40, 50)):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, processor)`` of the tiny random LLaVA-NeXT."""
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil, LlavaNextProcessor)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                          vision_feature_layer=-1, vision_feature_select_strategy="default", image_grid_pinpoints=GRIDS)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers starts the newline row at random; make it plainly nonzero
        model.model.image_newline.normal_()
    out = tmp_path_factory.mktemp("llava-next") / "tiny-llava-next"
    model.save_pretrained(out)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=GRIDS)
    proc = LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                              vision_feature_select_strategy="default", image_token="<image>",
                              num_additional_image_tokens=1)
    proc.save_pretrained(out)
    return out, model, proc


# a wide and a tall image: different grids, so different placeholder counts and padded patches
PROMPTS = [("Describe <image> please.", [_image(0, (30, 70))]),
           ("Compare <image> with <image>: which is brighter?", [_image(1, (70, 30)), _image(2, (40, 50))]),
           ("Tell me about the printing press.", [])]


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _reference(llava_next, greedy_ref, text, images):
    _, model, proc = llava_next
    inp = proc(text=text, images=images or None, return_tensors="pt")
    extra = {"pixel_values": inp["pixel_values"], "image_sizes": inp["image_sizes"]} if images else {}
    return greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, **extra)


def test_placeholder_counts_follow_the_image_shape(llava_next):
    """The two shapes of PROMPTS[1] take different grids (the test would not see a wrong size otherwise)."""
    _, model, proc = llava_next
    inp = proc(text=PROMPTS[1][0], images=PROMPTS[1][1], return_tensors="pt")
    feats = model.get_image_features(pixel_values=inp["pixel_values"], image_sizes=inp["image_sizes"])
    rows = [f.shape[0] for f in getattr(feats, "pooler_output", feats)]
    assert rows[0] != rows[1] and sum(rows) == int((inp["input_ids"] == model.config.image_token_id).sum())


@pytest.mark.parametrize("budget,blocks", [(2048, 96), (16, 96), (2048, 52)])
def test_llava_next_gives_transformers_tokens(llava_next, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 16 tokens (chunks end inside an image's 52-70 placeholders); 52
    blocks of 4 for three prompts of 7-135 tokens (50 blocks) (preemption: the images are encoded again)."""
    llm = LLM(str(llava_next[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    for (text, images), out in zip(PROMPTS, outs):
        ids, logits = _reference(llava_next, greedy_ref, text, images)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(images)} images")
    core = llm.engine.core
    assert core.scheduler.encoder.num_encoded >= 3
    if blocks == 52:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_same_image_hits_the_prefix_cache(llava_next, assert_no_leaks):
    """The second request with the same image reads its placeholders' blocks from the cache and runs no
    encoder step."""
    llm = LLM(str(llava_next[0]), num_kv_blocks=96, block_size=4)
    enc = llm.engine.core.scheduler.encoder
    text = "Describe <image> please, in detail."
    first = llm.generate([_request(text, [_image(2, (40, 50))])], GREEDY, use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = llm.generate([_request(text, [_image(2, (40, 50))])], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 1 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits >= 40
    assert_no_leaks(llm.engine)


def test_image_sizes_reach_a_core_process(llava_next, greedy_ref):
    """The per-image ``image_sizes`` travel with the pixels to the engine core process (msgpack over ZMQ)."""
    llm = LLM(str(llava_next[0]), num_kv_blocks=96, block_size=4, enable_multiprocessing=True)
    try:
        out = llm.generate([_request(*PROMPTS[1])], GREEDY, use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    ids, logits = _reference(llava_next, greedy_ref, *PROMPTS[1])
    greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "core process")


def test_image_embeddings_are_refused_naming_why(llava_next, assert_no_leaks):
    """LLaVA-NeXT's placeholder count depends on the image, so embeddings cannot be placed: refused
    (``--enable-mm-embeds`` on), naming the reason; the next request is served."""
    llm = LLM(str(llava_next[0]), num_kv_blocks=96, block_size=4, enable_mm_embeds=True)
    with pytest.raises(ValueError, match="depends on the image"):
        llm.generate([{"prompt": "Describe <image>.", "multi_modal_data": {"image": torch.zeros(1, 52, 64)}}],
                     GREEDY, use_tqdm=False)
    assert llm.generate([_request(*PROMPTS[0])], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm.engine)
