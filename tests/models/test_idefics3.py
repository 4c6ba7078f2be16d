"""Idefics3 and SmolVLM2 (issue 41): an image is split into crops plus a downscaled global
view, and each crop's placeholders are a run of their own after its ``<row_i_col_j>`` text, so one
image's placeholders are several runs with text between (``MultiModalInput.runs``); the processor
pads all images' crops into one ``[1, crops, C, H, W]`` array, so each image is processed alone for
its own crops and count. A tiny random Idefics3 (a SigLIP-style tower at 32 px, pixel shuffle 2, a
2-layer Llama with SmolLM2's vocabulary) through the Transformers backend gives ``transformers``'
greedy tokens and top-5 logprobs (float32) for one and two images (split into 2 x 2 and 1 x 2 crops,
each + global) beside a text-only prompt, whole, chunked inside and between an image's runs, and
preempted; the same image again hits the prefix cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)


def _image(seed: int, size):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def idefics3(request, tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, processor)`` of the tiny random Idefics3, or SmolVLM2
    (the same layout; its processor is ours, ``multimodal_patches.smolvlm_processor``: transformers'
    builds a torchvision video processor)."""
    import json

    import transformers
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor, SmolVLMImageProcessorPil
    smol = request.param == "smolvlm"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>"]})
    config_cls, model_cls = (("SmolVLMConfig", "SmolVLMForConditionalGeneration") if smol
                             else ("Idefics3Config", "Idefics3ForConditionalGeneration"))
    cfg = getattr(transformers, config_cls)(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2),
        image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    out = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}"
    model.save_pretrained(out)
    images = (SmolVLMImageProcessorPil if smol else Idefics3ImageProcessorPil)(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
    proc = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
    if smol:  # as SmolVLM2's checkpoints carry it (SmolVLMProcessor itself cannot be built here)
        tok.save_pretrained(out)
        images.save_pretrained(out)
        (out / "processor_config.json").write_text(json.dumps({"processor_class": "SmolVLMProcessor",
                                                               "image_seq_len": 4}))
    else:
        proc.save_pretrained(out)
    return out, model, proc


# 40 x 64 px: 2 x 2 crops + the global view (5 runs of 4); 20 x 64 px: 1 x 2 crops + global (3 runs)
PROMPTS = [("Describe <image> please.", [_image(0, (40, 64))]),
           ("Compare <image> with <image>: which is brighter?", [_image(1, (40, 64)), _image(2, (20, 64))]),
           ("Tell me about the printing press.", [])]


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _reference(idefics3, greedy_ref, text, images):
    _, model, proc = idefics3
    inp = proc(text=text, images=images or None, return_tensors="pt")
    extra = {"pixel_values": inp["pixel_values"], "pixel_attention_mask": inp["pixel_attention_mask"]} if images else {}
    return greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, **extra)


def test_an_image_is_several_runs(idefics3):
    from pagedllm.multimodal import MultiModalProcessor
    from pagedllm.multimodal_inputs import MultiModalPrompt
    path, model, _ = idefics3
    ids, mm = MultiModalProcessor(path, model.config.image_token_id, 8, model_type=model.config.model_type)(
        MultiModalPrompt(*PROMPTS[1]))
    assert [len(m.row_runs()) for m in mm] == [5, 3] and [m.rows for m in mm] == [20, 12]
    assert [m.shape[0] for m in mm] == [5, 3]  # each image's own crops, not padded to the prompt's most
    for m in mm:
        assert all(ids[m.offset + a + j] == model.config.image_token_id for a, n in m.row_runs() for j in range(n))


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (6, 64), (2048, 50)])
def test_idefics3_gives_transformers_tokens(idefics3, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 6 tokens (chunks end inside runs and in the text between an image's
    runs); 50 blocks of 4 for three prompts of 7-110 tokens (48 blocks; preemption)."""
    llm = LLM(str(idefics3[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    for (text, images), out in zip(PROMPTS, outs):
        ids, logits = _reference(idefics3, greedy_ref, text, images)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(images)} images")
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, f"{len(images)} images")
    core = llm.engine.core
    if blocks == 50:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_same_image_hits_the_prefix_cache(idefics3, greedy_ref, assert_no_leaks):
    llm = LLM(str(idefics3[0]), num_kv_blocks=64, block_size=4)
    enc = llm.engine.core.scheduler.encoder
    text = "Describe <image> please, in detail and at length."
    first = llm.generate([_request(text, [_image(0, (40, 64))])], GREEDY, use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = llm.generate([_request(text, [_image(0, (40, 64))])], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 1 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits >= 40
    ids, logits = _reference(idefics3, greedy_ref, text, [_image(0, (40, 64))])
    greedy_ref.assert_logprobs(again.outputs[0], ids, logits, "prefix hit")
    assert_no_leaks(llm.engine)
