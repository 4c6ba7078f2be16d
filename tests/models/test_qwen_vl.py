"""Qwen2.5-VL and Qwen2-VL (issue 41): images as a variable grid of flattened patches and M-RoPE,
the rotary positions of image tokens three numbers (temporal, height, width) and every token after an
image shifted by the image's extent rather than its length. A tiny random Qwen2.5-VL (a 2-block vision
tower with one windowed and one full block, 14 px patches merged 2 x 2, before a 2-layer text model
with SmolLM2's vocabulary), and a Qwen2-VL of the same shapes, through the Transformers backend give
``transformers``' greedy tokens and top-5 logprobs (float32) for one and two images (a wide and a tall
grid of equal token count: only their positions differ) beside a text-only prompt, whole, chunked
through an image and preempted; the same image again hits the prefix cache. The processor is ours
(``multimodal_patches``: transformers' own needs torchvision); its output is checked against
transformers' expansion rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed: int, size):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


# family -> (config and model classes, tiny vision tower, patch size): Qwen2.5-VL's windowed blocks,
# Qwen2-VL's plain ones, Qwen3-VL's with deepstack rows from both blocks into the first two text layers
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]), 14),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2), 14),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0, 1],
                      num_position_embeddings=64), 16)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen_vl(request, tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, prompts)`` of the tiny random model of one family."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    config_cls, model_cls, vision, patch = FAMILIES[request.param]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                          "<|video_pad|>"]})
    start, pad, end, video = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                        "<|video_pad|>"])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                                 "mrope_interleaved": request.param == "qwen3_vl"})
    cfg = getattr(transformers, config_cls)(vision_config=vision, text_config=text, image_token_id=pad,
                                            video_token_id=video, vision_start_token_id=start,
                                            vision_end_token_id=end, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # sharper attention: at transformers' initial scale it barely depends on positions
        for layer in model.model.language_model.layers:
            attn = layer.self_attn
            for w in ((attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm")  # Qwen3: after the norm
                      else (attn.q_proj.weight, attn.k_proj.weight)):
                w.mul_(8)
    out = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    unit = 2 * patch  # a merged patch
    Qwen2VLImageProcessorPil(min_pixels=unit * unit * 4, max_pixels=unit * unit * 16, patch_size=patch, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out)
    # a wide and a tall image: grids of 4 x 6 and 6 x 4 patches, 6 tokens each
    wide, tall = (2 * unit, 3 * unit), (3 * unit, 2 * unit)
    prompts = [(f"Describe {IMAGE} please.", [_image(0, wide)]),
               (f"Compare {IMAGE} with {IMAGE}: which is brighter?", [_image(1, wide), _image(2, tall)]),
               ("Tell me about the printing press.", [])]
    return out, model, prompts


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _inputs(qwen_vl, text, images):
    from pagedllm.multimodal_patches import PATCH_PROCESSOR_TOKENS, PatchTokenProcessor
    proc = PatchTokenProcessor(qwen_vl[0], PATCH_PROCESSOR_TOKENS[qwen_vl[1].config.model_type])
    out = {k: torch.from_numpy(v) for k, v in proc(text=text, images=images).items()}
    if images:
        out["mm_token_type_ids"] = (out["input_ids"] == qwen_vl[1].config.image_token_id).int()
    return out


def _reference(qwen_vl, greedy_ref, text, images):
    inp = _inputs(qwen_vl, text, images)
    extra = {k: inp[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")} if images else {}
    return greedy_ref.hf_greedy(qwen_vl[1], inp["input_ids"][0].tolist(), MAX_NEW, **extra)


def test_processor_and_positions_matter(qwen_vl):
    """Our processor expands each image to prod(grid) / 4 tokens; M-RoPE moves the logprobs by more
    than 10x the tests' tolerance (a server on 1-D positions fails the logprob checks below)."""
    _, model, prompts = qwen_vl
    inp = _inputs(qwen_vl, *prompts[1])
    assert inp["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 4]]
    assert int((inp["input_ids"] == model.config.image_token_id).sum()) == 12
    with torch.no_grad():
        kw = {k: inp[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
        mrope = model(input_ids=inp["input_ids"], **kw).logits[0, -1].log_softmax(-1)
        flat = model(input_ids=inp["input_ids"], position_ids=torch.arange(inp["input_ids"].shape[1])[None],
                     **kw).logits[0, -1].log_softmax(-1)
    assert (mrope - flat).abs().max() > 1e-2


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (4, 64), (2048, 14)])
def test_qwen2_5_vl_gives_transformers_tokens(qwen_vl, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 4 tokens (chunks end inside an image's 6 placeholders); 14 blocks of
    4 for three prompts of 7-25 tokens (12 blocks; preemption: the images are encoded again, positions kept)."""
    llm = LLM(str(qwen_vl[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    prompts = qwen_vl[2]
    outs = llm.generate([_request(t, i) for t, i in prompts], GREEDY, use_tqdm=False)
    for (text, images), out in zip(prompts, outs):
        ids, logits = _reference(qwen_vl, greedy_ref, text, images)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(images)} images")
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, f"{len(images)} images")
    core = llm.engine.core
    if blocks == 14:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    llm.generate(["ok"], SamplingParams(max_tokens=1), use_tqdm=False)  # delivers the last finished ids
    assert not core.runner.encoder_cache.rope and not core.runner.encoder_cache.images
    assert_no_leaks(llm.engine)


def test_same_image_hits_the_prefix_cache(qwen_vl, greedy_ref, assert_no_leaks):
    llm = LLM(str(qwen_vl[0]), num_kv_blocks=64, block_size=4)
    enc = llm.engine.core.scheduler.encoder
    text, image = f"Describe {IMAGE} please, in detail and at length.", qwen_vl[2][0][1]
    first = llm.generate([_request(text, image)], GREEDY, use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = llm.generate([_request(text, image)], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 1 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits >= 8
    ids, logits = _reference(qwen_vl, greedy_ref, text, image)
    greedy_ref.assert_logprobs(again.outputs[0], ids, logits, "prefix hit")
    assert_no_leaks(llm.engine)
