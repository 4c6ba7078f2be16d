"""Gemma 3 with images (issue 41): a tiny random Gemma 3 (a SigLIP tower at 32 px pooled to 16 image
tokens per image, in front of a 3-layer Gemma 3 text model, full / sliding (window 8) / full, with
SmolLM2's vocabulary plus Gemma's three image tokens, and its own ``Gemma3Processor``) served through
the Transformers backend. Its image tokens attend to each other both ways (``transformers`` builds
the masks from ``token_type_ids``: full layers causal OR same image, sliding layers AND the window):
our tokens and logprobs equal ``transformers``' with those masks and differ from the causal ones,
whole, with a token budget that would end a chunk inside an image (the scheduler stops before it),
and under preemption; a prefix-cache hit through an image keeps them; an image longer than the token
budget is refused naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.encoder_cache import EncoderScheduler

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
IMAGE = "<start_of_image>"


def _image(seed: int, size=(40, 50)):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_dir):
    """``(directory, transformers model, processor)`` of the tiny random Gemma 3."""
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)
    tok = AutoTokenizer.from_pretrained(smollm2_dir, extra_special_tokens={
        "boi_token": IMAGE, "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})
    init = 0.2  # large enough that the image tokens' two-way attention moves the logits (by ~0.1)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=4, initializer_range=init)
    layers = ["full_attention", "sliding_attention", "full_attention"]
    text = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            layer_types=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            sliding_window=8, initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                       boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                       image_token_index=tok.image_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers starts the projector at zero: every image would embed to zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, init)
    out = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    model.save_pretrained(out)
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tok,
                           image_seq_length=16, chat_template=tok.chat_template)
    proc.save_pretrained(out)
    return out, model, proc


PROMPTS = [(f"Describe {IMAGE} please.", [_image(0)]),
           (f"Compare {IMAGE} with {IMAGE}: which is brighter?", [_image(1), _image(2, (30, 30))]),
           ("Tell me about the printing press.", [])]


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _reference(gemma3, greedy_ref, text, images, two_way: bool = True):
    """transformers' greedy ids and step logits; ``two_way``: with the processor's ``token_type_ids``
    (the image masks), else causal everywhere."""
    _, model, proc = gemma3
    inp = proc(text=text, images=images or None, return_tensors="pt")
    extra = {"pixel_values": inp["pixel_values"]} if images else {}
    if images and two_way:
        extra["token_type_ids"] = inp["token_type_ids"]
    return greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, **extra)


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (36, 64), (2048, 16)])
def test_gemma3_images_attend_both_ways(gemma3, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 36 tokens (the two-image prompt alone: its first chunk would end at
    35, inside its second image at 24-39, both images within the encoder budget; the chunk stops
    before it and the image goes whole into the next); 16 blocks of 4 for three prompts of 25-48
    tokens (preemption). transformers' tokens and top-5 logprobs with the image masks; the causal
    masks' logprobs are off by more than 10x the tolerance (the check has teeth)."""
    llm = LLM(str(gemma3[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    if budget == 2048:
        outs = llm.generate([_request(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    else:  # one at a time: the two-image prompt's first chunk alone would end inside its second image
        outs = [llm.generate([_request(t, i)], GREEDY, use_tqdm=False)[0] for t, i in PROMPTS]
    for (text, images), out in zip(PROMPTS, outs):
        ids, logits = _reference(gemma3, greedy_ref, text, images)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(images)} images")
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, f"{len(images)} images")
        if images and budget == 2048 and blocks == 64:
            causal_ids, causal_logits = _reference(gemma3, greedy_ref, text, images, two_way=False)
            with pytest.raises(AssertionError):
                greedy_ref.assert_logprobs(out.outputs[0], causal_ids, causal_logits, "causal", tol=1e-2)
    if blocks == 16:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    core = llm.engine.core
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)


def test_a_prefix_cache_hit_through_an_image_keeps_the_logprobs(gemma3, greedy_ref, assert_no_leaks):
    """The second request reuses the first's blocks, the image's included (block size 4: the hit ends
    inside the text after the image); its remaining tokens give the same logprobs."""
    llm = LLM(str(gemma3[0]), num_kv_blocks=64, block_size=4)
    text, images = PROMPTS[0][0] + " In detail.", PROMPTS[0][1]
    first = llm.generate([_request(text, images)], GREEDY, use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = llm.generate([_request(text, images)], GREEDY, use_tqdm=False)[0]
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits >= 16
    ids, logits = _reference(gemma3, greedy_ref, text, images)
    for out in (first, again):
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, "prefix hit")
    assert_no_leaks(llm.engine)


def test_an_image_longer_than_the_token_budget_is_refused(gemma3, assert_no_leaks):
    llm = LLM(str(gemma3[0]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"multi_modal_data: an image takes 16 tokens, more than "
                                         r"--max-num-batched-tokens \(8\)"):
        llm.generate([_request(*PROMPTS[0])], GREEDY, use_tqdm=False)
    assert llm.generate([PROMPTS[2][0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_whole_images_stop_a_chunk_before_an_image():
    """``EncoderScheduler.fit`` with ``whole_images``: a chunk that would end inside an image stops
    before it; one that starts at the image and holds it whole keeps its length."""
    from pagedllm.multimodal_inputs import MultiModalInput

    class Req:
        request_id, num_computed_tokens = "r", 0
        mm_inputs = [MultiModalInput("h1", 3, 16, b"", [1]), MultiModalInput("h2", 22, 16, b"", [1])]
    enc, req = EncoderScheduler(64, whole_images=True), Req()
    assert enc.fit(req, 10) == 3  # inside image 1: stop before it
    assert enc.fit(req, 24) == 22  # image 1 whole, image 2 cut off: stop before image 2
    req.num_computed_tokens = 3
    assert enc.fit(req, 16) == 16 and enc.fit(req, 15) == 0
    assert EncoderScheduler(64).fit(req, 10) == 10  # split images are fine for a causal model


def test_llm_chat_with_an_image(gemma3, greedy_ref):
    """``LLM.chat`` puts Gemma 3's ``<start_of_image>`` before the text (the processor expands it);
    transformers' tokens and logprobs on the same rendered prompt, with the image masks."""
    path, model, proc = gemma3
    img = _image(4)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                 {"type": "image_pil", "image_pil": img}]}], GREEDY, use_tqdm=False)[0]
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": f"{IMAGE}\nWhat is it?"}], tokenize=False,
                                              add_generation_prompt=True)
    inp = proc(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    ids, logits = greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, pixel_values=inp["pixel_values"],
                                       token_type_ids=inp["token_type_ids"])
    assert out.prompt_token_ids == inp["input_ids"][0].tolist()
    greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "LLM.chat")
    greedy_ref.assert_logprobs(out.outputs[0], ids, logits, "LLM.chat")


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}


def test_pan_and_scan_crops_attend_within_each_crop(gemma3, greedy_ref, assert_no_leaks):
    """``--mm-processor-kwargs '{"do_pan_and_scan": true, ...}'``: a wide image becomes the original
    plus crops, each a run of its own between text; the tokens of each run attend to each other both
    ways (transformers' masks); transformers' tokens and logprobs with the same processor settings."""
    from pagedllm.multimodal import MultiModalProcessor
    from pagedllm.multimodal_inputs import MultiModalPrompt
    path, model, proc = gemma3
    text, images = f"Describe {IMAGE} please.", [_image(5, (30, 90))]
    _, mm = MultiModalProcessor(path, model.config.image_token_id, 4, processor_kwargs=PAN_AND_SCAN)(
        MultiModalPrompt(text, tuple(images)))
    assert len(mm[0].row_runs()) >= 3 and mm[0].rows == 16 * len(mm[0].row_runs())
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, mm_processor_kwargs=PAN_AND_SCAN)
    out = llm.generate([_request(text, images)], GREEDY, use_tqdm=False)[0]
    inp = proc(text=text, images=images, return_tensors="pt", **PAN_AND_SCAN)
    ids, logits = greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, pixel_values=inp["pixel_values"],
                                       token_type_ids=inp["token_type_ids"])
    greedy_ref.assert_logprobs(out.outputs[0], ids, logits, "pan and scan")
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kwargs,match", [({"do_pan_and_scan": True, "no_such_setting": 1}, "no_such_setting"),
                                          ({"pan_and_scan_min_crop_size": "big"}, "mm-processor-kwargs")])
def test_bad_processor_kwargs_are_refused_at_start(gemma3, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(gemma3[0]), num_kv_blocks=16, block_size=4, mm_processor_kwargs=kwargs)


def test_mm_processor_kwargs_flag_reaches_the_engine_args(tiny_model_dir):
    """``--mm-processor-kwargs`` (vLLM's flag) is a JSON object in ``EngineArgs``; anything else is
    refused by the parser; a text-only model refuses the setting."""
    import argparse

    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_flags(p)
    args = p.parse_args(["m", "--mm-processor-kwargs", '{"do_pan_and_scan": true}'])
    assert engine_args_from_cli(args).mm_processor_kwargs == {"do_pan_and_scan": True}
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--mm-processor-kwargs", "[1]"])
    with pytest.raises(ValueError, match="--mm-processor-kwargs: this model reads text only"):
        LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, mm_processor_kwargs={"do_pan_and_scan": True})
