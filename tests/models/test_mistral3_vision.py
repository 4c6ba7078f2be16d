"""Mistral 3 with its Pixtral vision tower (issue 41): an image becomes rows of ``[IMG]`` placeholders,
each row closed by ``[IMG_BREAK]`` and the last by ``[IMG_END]``, so one image is several runs (one per
patch row) with break tokens between; images of different shapes are padded to the largest and
cropped back by their ``image_sizes``. The processor is ours (``multimodal_patches``: transformers'
``PixtralProcessor`` needs torchvision); its expansion is checked against transformers' rule. A tiny random Mistral 3 (a 2-layer Pixtral tower with 8 px
patches merged 2 x 2, a 2-layer Mistral with SmolLM2's vocabulary) through the Transformers backend
gives ``transformers``' greedy tokens and top-5 logprobs (float32) for one and two images beside a
text-only prompt, whole, chunked inside and between rows, and preempted.
"""

from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}


def _image(seed: int, size):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model)`` of the tiny random Mistral 3."""
    from transformers import (AutoTokenizer, Mistral3Config, Mistral3ForConditionalGeneration,
                              PixtralImageProcessorPil)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": list(TOKENS.values())})
    cfg = Mistral3Config(
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=16, image_size=64, patch_size=8),
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2),
        image_token_id=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("mistral3") / "tiny-mistral3"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor", "patch_size": 8,
                                                           "spatial_merge_size": 2, **TOKENS}))
    return out, model


# 40 x 64 px: 3 rows of 4 (resized to 48 x 64, multiples of 16); 64 x 30 px: 4 rows of 2 (64 x 32)
PROMPTS = [("Describe [IMG] please.", [_image(0, (40, 64))]),
           ("Compare [IMG] with [IMG]: which is brighter?", [_image(1, (40, 64)), _image(2, (64, 30))]),
           ("Tell me about the printing press.", [])]


def _request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _inputs(mistral3, text, images):
    from pagedllm.multimodal_patches import PixtralTokenProcessor
    out = PixtralTokenProcessor(mistral3[0])(text=text, images=images)
    return {k: torch.as_tensor(np.asarray(v)) for k, v in out.items()}


def _reference(mistral3, greedy_ref, text, images):
    inp = _inputs(mistral3, text, images)
    extra = {"pixel_values": inp["pixel_values"], "image_sizes": inp["image_sizes"]} if images else {}
    return greedy_ref.hf_greedy(mistral3[1], inp["input_ids"][0].tolist(), MAX_NEW, **extra)


def test_expansion_follows_transformers_rule(mistral3):
    """Each image: per patch row (of 16 px: 8 px patches merged 2 x 2) its ``[IMG]`` tokens and
    ``[IMG_BREAK]``, the last break ``[IMG_END]`` (transformers' ``PixtralProcessor.replace_image_token``,
    which cannot be imported here: its module needs torchvision); an image's runs are its rows."""
    from transformers import AutoTokenizer

    from pagedllm.multimodal import MultiModalProcessor
    from pagedllm.multimodal_inputs import MultiModalPrompt
    path, model = mistral3
    inp = _inputs(mistral3, *PROMPTS[1])
    assert inp["image_sizes"].tolist() == [[48, 64], [64, 32]]
    rows = [("[IMG]" * 4 + "[IMG_BREAK]") * 2 + "[IMG]" * 4 + "[IMG_END]",
            ("[IMG]" * 2 + "[IMG_BREAK]") * 3 + "[IMG]" * 2 + "[IMG_END]"]
    want = AutoTokenizer.from_pretrained(path)(f"Compare {rows[0]} with {rows[1]}: which is brighter?")["input_ids"]
    assert inp["input_ids"][0].tolist() == want
    ids, mm = MultiModalProcessor(path, model.config.image_token_id, 8, model_type="mistral3")(
        MultiModalPrompt(*PROMPTS[1]))
    assert [len(m.row_runs()) for m in mm] == [3, 4] and [m.rows for m in mm] == [12, 8]


@pytest.mark.parametrize("budget,blocks", [(2048, 64), (3, 64), (2048, 16)])
def test_mistral3_gives_transformers_tokens(mistral3, greedy_ref, assert_no_leaks, budget, blocks):
    """Whole prompts; a budget of 3 tokens (chunks end inside rows and at break tokens); 16 blocks of 4
    for three prompts of 7-36 tokens (16 blocks at admission; preemption)."""
    llm = LLM(str(mistral3[0]), num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate([_request(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    for (text, images), out in zip(PROMPTS, outs):
        ids, logits = _reference(mistral3, greedy_ref, text, images)
        greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, f"{len(images)} images")
        greedy_ref.assert_logprobs(out.outputs[0], ids, logits, f"{len(images)} images")
    core = llm.engine.core
    if blocks == 16:
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert not core.scheduler.encoder.holders and not core.runner.encoder_cache.entries
    assert_no_leaks(llm.engine)
