"""Images in prompts (issue 41, first part): a tiny random LLaVA (a CLIP vision tower at 32 px, 16
placeholder tokens per image, in front of a 2-layer Llama with SmolLM2's vocabulary and its own
processor) served through the Transformers backend gives ``transformers``' greedy tokens (float32)
for one and two images per prompt beside a text-only prompt, whole and chunked through an image,
and under preemption; a second request with the same image hits the prefix cache and runs no
encoder step, one with another image misses; the encoder cache is empty once requests end; bad
image input is refused naming the field and costs nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _image(seed: int, size=(40, 50)):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def llava(tiny_llava):
    return tiny_llava


PROMPTS = [("Describe <image> please.", [_image(0)]),
           ("Compare <image> with <image>: which is brighter?", [_image(1), _image(2, (30, 30))]),
           ("Tell me about the printing press.", [])]


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _reference(llava, greedy_ref, text, images):
    _, model, proc = llava
    inp = proc(text=text, images=images or None, return_tensors="pt")
    extra = {"pixel_values": inp["pixel_values"]} if images else {}
    return greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, **extra)


def _encoder_empty(llm) -> bool:
    core = llm.engine.core
    return not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (8, 64), (2048, 14)])
def test_llava_gives_transformers_tokens(llava, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 8 tokens (chunks end inside the 16 placeholders of an image, and
    one image per step fits the encoder budget); 14 blocks of 4 for three prompts of 25-40 tokens
    (preemption: the preempted request's images are encoded again)."""
    path = llava[0]
    llm = LLM(str(path), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    for (text, images), out in zip(PROMPTS, outs):
        ids, logits = _reference(llava, greedy_ref, text, images)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(images)} images")
    core = llm.engine.core
    assert core.scheduler.encoder.num_encoded >= 3
    if blocks == 14:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert _encoder_empty(llm)
    assert_no_leaks(llm.engine)


def test_touching_image_tokens_are_two_images(llava, greedy_ref, assert_no_leaks):
    """``<image><image>``: the two images' placeholders make one run, split by each image's count."""
    text, images = "USER: <image><image>\nWhich is brighter?", [_image(4), _image(5, (30, 30))]
    llm = LLM(str(llava[0]), num_kv_blocks=64, block_size=4)
    out = llm.generate([_request(text, images)], GREEDY, use_tqdm=False)[0]
    ids, logits = _reference(llava, greedy_ref, text, images)
    greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "touching images")
    assert llm.engine.core.scheduler.encoder.num_encoded == 2
    assert_no_leaks(llm.engine)


def test_same_image_hits_the_prefix_cache_and_runs_no_encoder(llava, assert_no_leaks):
    llm = LLM(str(llava[0]), num_kv_blocks=64, block_size=4)
    enc = llm.engine.core.scheduler.encoder
    text = "Describe <image> please, in detail and at length."
    first = llm.generate([_request(text, [_image(0)])], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 1
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = llm.generate([_request(text, [_image(0)])], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 1 and again.outputs[0].token_ids == first.outputs[0].token_ids
    hits_same = llm.llm_engine.get_stats().prefix_cache_hits - hits
    assert hits_same >= 16  # the image's placeholders came from the cache
    other = llm.generate([_request(text, [_image(7)])], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 2  # another image: its blocks miss, its encoder step runs
    hits_other = llm.llm_engine.get_stats().prefix_cache_hits - hits - hits_same
    assert hits_other < 4  # at most the block before the image (same text up to it)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids or hits_other < hits_same
    salted = llm.generate([{**_request(text, [_image(0)]), "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    assert enc.num_encoded == 3 and salted.outputs[0].token_ids == first.outputs[0].token_ids
    assert _encoder_empty(llm)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("request_,match", [
    ({"prompt": "No placeholder here.", "multi_modal_data": {"image": [_image(0)]}}, "multi_modal_data"),
    ({"prompt": "<image> <image>", "multi_modal_data": {"image": [_image(0)] * 3}}, "multi_modal_data"),
    ({"prompt": "<image>", "multi_modal_data": {"image": "not an image"}}, r"multi_modal_data\.image"),
    ({"prompt": "<image>", "multi_modal_data": {"audio": [1.0]}}, r"multi_modal_data\.audio"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [_image(0)]}}, "multi_modal_data"),
])
def test_bad_image_input_is_refused_and_costs_nothing(llava, assert_no_leaks, request_, match):
    llm = LLM(str(llava[0]), num_kv_blocks=64, block_size=4, limit_mm_per_prompt={"image": 2})
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate([request_], GREEDY, use_tqdm=False)
    assert llm.generate([_request(*PROMPTS[0])], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert _encoder_empty(llm)
    assert_no_leaks(llm.engine)


def test_an_image_for_a_text_only_model_is_refused(tiny_model_dir, assert_no_leaks):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16)
    with pytest.raises(ValueError, match="multi_modal_data: this model reads text only"):
        llm.generate([_request("Look: <image>", [_image(0)])], GREEDY, use_tqdm=False)
    assert llm.generate(["ok"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_llm_chat_with_image_parts(llava, greedy_ref):
    """``LLM.chat`` takes vLLM's ``image_pil`` and OpenAI's ``image_url`` parts: the placeholder goes
    before the text, as the server renders it; transformers' tokens on the same rendered prompt."""
    import base64
    import io
    path, model, proc = llava
    img = _image(4)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    outs = [llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}], GREEDY,
                     use_tqdm=False)[0] for part in ({"type": "image_pil", "image_pil": img},
                                                     {"type": "image_url", "image_url": {"url": url}})]
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nWhat is it?"}], tokenize=False,
                                              add_generation_prompt=True)
    inp = proc(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    ids, logits = greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), MAX_NEW, pixel_values=inp["pixel_values"])
    for out in outs:
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "LLM.chat with an image")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: this model takes no audio"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: 'input_file' parts"):
        llm.chat([{"role": "user", "content": [{"type": "input_file", "input_file": {}}]}], GREEDY, use_tqdm=False)


def test_images_reach_a_core_process(llava):
    """The images travel to the engine core process (msgpack over ZMQ) and give the in-process tokens."""
    got = {}
    for mp in (True, False):
        llm = LLM(str(llava[0]), num_kv_blocks=64, block_size=4, enable_multiprocessing=mp)
        assert llm.llm_engine.multiprocess == mp
        got[mp] = llm.generate([_request(*PROMPTS[1])], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.llm_engine.shutdown()
    assert got[True] == got[False]


def _embeddings(llava, images):
    """transformers' vision tower and projector on the images: ``[images, 16, hidden]``."""
    _, model, proc = llava
    with torch.no_grad():
        feats = model.get_image_features(pixel_values=proc.image_processor(images, return_tensors="pt")["pixel_values"])
    return torch.stack(list(getattr(feats, "pooler_output", feats)))


def test_image_embeddings_stand_for_the_images(llava, greedy_ref, assert_no_leaks):
    """``LLM(enable_mm_embeds=True)`` takes vLLM's ``{"image": tensor [images, rows, hidden]}``: the
    rows go over the placeholders as the tower's would (transformers' tokens on the images); without
    the flag, of the wrong width or rows, or for a model whose count depends on the image: refused."""
    text, images = PROMPTS[1]
    emb = _embeddings(llava, images)
    llm = LLM(str(llava[0]), num_kv_blocks=64, block_size=4, enable_mm_embeds=True)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": emb}}], GREEDY, use_tqdm=False)[0]
    ids, logits = _reference(llava, greedy_ref, text, images)
    greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "image embeddings")
    for bad, match in ((emb[:, :, :8], "image embeddings"), (emb[:, :10], "10 rows"),
                       (emb * float("nan"), "NaN")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": text, "multi_modal_data": {"image": bad}}], GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)
    plain = LLM(str(llava[0]), num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="enable-mm-embeds"):
        plain.generate([{"prompt": text, "multi_modal_data": {"image": emb}}], GREEDY, use_tqdm=False)
