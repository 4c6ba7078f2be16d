"""llama.cpp's two files for Gemma 3 (issue 41): the language model's GGUF (the real gemma-3-270m,
Q4_K_M, from its wheels) and an ``--mmproj`` GGUF holding a tiny random SigLIP tower (32 px, patch 4,
pooled by 2 to 16 image tokens) and Gemma 3's projector, written as llama.cpp's
``convert_hf_to_gguf.py --mmproj`` writes it (``gguf``'s MMPROJ tensor names, ``clip.vision.*``
keys, the soft-embedding norm stored as ``1 + w``). ``LLM("gemma-3-270m", mmproj=...)`` serves
them as one Gemma 3 image-text model, its language model's blocks packed as the text model's are:
``transformers``' tokens and logprobs of the same (dequantized) weights with the image masks; the text-only vocabulary gains the image soft token after its end, as the 4B+
models have it. A file that is no mmproj, and a projector for another family, are refused naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models import real_models

SPEC = real_models.GEMMA3_270M


def _has_wheels() -> bool:
    try:
        real_models.find_parts(SPEC)
    except real_models.ModelNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_wheels(), reason="needs the gemma-3-270m wheels: " + "; ".join(SPEC.pip_commands))
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=4, vision_use_head=False, layer_norm_eps=1e-6)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)


def _write_mmproj(path, state: dict[str, torch.Tensor], projector: str = "gemma3") -> None:
    """An mmproj GGUF of the vision tower and projector in ``state`` (Hugging Face names), as llama.cpp's
    converter writes one: its names through ``gguf``'s MMPROJ map, Gemma's soft-embedding norm as
    ``1 + w``, the tower's shapes as ``clip.vision.*`` keys, pooled by 2 (``projector.scale_factor``)."""
    import gguf
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, VISION["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector)
    w.add_uint32(gguf.Keys.ClipVision.IMAGE_SIZE, VISION["image_size"])
    w.add_uint32(gguf.Keys.ClipVision.PATCH_SIZE, VISION["patch_size"])
    w.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, VISION["hidden_size"])
    w.add_uint32(gguf.Keys.ClipVision.FEED_FORWARD_LENGTH, VISION["intermediate_size"])
    w.add_uint32(gguf.Keys.ClipVision.BLOCK_COUNT, VISION["num_hidden_layers"])
    w.add_uint32(gguf.Keys.ClipVision.Attention.HEAD_COUNT, VISION["num_attention_heads"])
    w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, VISION["layer_norm_eps"])
    w.add_array(gguf.Keys.ClipVision.IMAGE_MEAN, [0.5, 0.5, 0.5])
    w.add_array(gguf.Keys.ClipVision.IMAGE_STD, [0.5, 0.5, 0.5])
    w.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, 2)
    for key, t in state.items():
        legacy = key[len("model."):].replace("vision_tower.", "vision_tower.vision_model.", 1)
        legacy = legacy.replace("mm_input_projection_weight", "mm_input_projection.weight")
        data = t.numpy().astype(np.float32) + (1.0 if "soft_emb_norm" in key else 0.0)
        w.add_tensor(names.get_name(legacy, try_suffixes=(".weight", ".bias")), data)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    """``(mmproj path, transformers Gemma3ForConditionalGeneration of the same weights)``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from pagedllm.models.resolve import resolve_model
    text_dir = resolve_model("gemma-3-270m")
    cfg = Gemma3Config(text_config=AutoConfig.from_pretrained(text_dir).to_dict(),
                       vision_config=SiglipVisionConfig(**VISION).to_dict(), mm_tokens_per_image=16,
                       boi_token_index=255999, eoi_token_index=256000, image_token_index=262144)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    state = {k: torch.randn(v.shape) * 0.2 for k, v in model.state_dict().items()
             if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    path = tmp_path_factory.mktemp("mmproj") / "mmproj-tiny.gguf"
    _write_mmproj(path, state)
    for name, t in load_file(str(text_dir / "model.safetensors")).items():
        state[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    assert not result.unexpected_keys and all(k.endswith("lm_head.weight") for k in result.missing_keys)
    return path, model.eval()


def _image(seed: int):
    from PIL import Image
    return Image.fromarray((np.random.default_rng(seed).random((40, 50, 3)) * 255).astype("uint8"))


def test_two_llama_cpp_files_serve_gemma3_with_images(joined, greedy_ref, assert_no_leaks):
    from transformers import AutoProcessor
    path, model = joined
    llm = LLM("gemma-3-270m", mmproj=str(path), num_kv_blocks=64, block_size=16)
    proc = AutoProcessor.from_pretrained(llm.llm_engine.model_dir)
    from pagedllm.models.quant_linear import GGUFLinear  # the language model's blocks stay packed
    packed = [m for m in llm.engine.core.runner.model.hf.model.language_model.modules() if isinstance(m, GGUFLinear)]
    assert len(packed) >= 18 * 7, len(packed)
    assert proc.image_seq_length == 16 and proc.image_processor.size == {"height": 32, "width": 32}
    assert proc.tokenizer.convert_tokens_to_ids("<image_soft_token>") == 262144  # after the 270m's vocabulary
    text, img = "Describe <start_of_image> in one word.", _image(0)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [img]}}], GREEDY, use_tqdm=False)[0]
    inp = proc(text=text, images=[img], return_tensors="pt")
    assert out.prompt_token_ids == inp["input_ids"][0].tolist()
    ids, logits = greedy_ref.hf_greedy(model, inp["input_ids"][0].tolist(), 4, pixel_values=inp["pixel_values"],
                                       token_type_ids=inp["token_type_ids"])
    greedy_ref.assert_greedy_match(list(out.outputs[0].token_ids), ids, logits, "gguf + mmproj")
    ref_lp = torch.log_softmax(logits.double(), -1)
    for i, lp in enumerate(out.outputs[0].logprobs):
        for t, v in lp.items():
            assert abs(v.logprob - float(ref_lp[i, t])) < 2e-3, (i, t, v.logprob, float(ref_lp[i, t]))
        if out.outputs[0].token_ids[i] != ids[i]:
            break
    other = llm.generate([{"prompt": text, "multi_modal_data": {"image": [_image(1)]}}], GREEDY, use_tqdm=False)[0]
    assert other.outputs[0].logprobs[0] != out.outputs[0].logprobs[0]  # the image reaches the model
    assert_no_leaks(llm.engine)


def test_not_an_mmproj_or_another_projector_is_refused(tmp_path, joined):
    from pagedllm.models.gguf_mmproj import read_mmproj
    path, model = joined
    with pytest.raises(ValueError, match="not an mmproj file"):
        read_mmproj(real_models.join_gguf(SPEC))
    other = tmp_path / "mmproj-llava.gguf"
    _write_mmproj(other, {k: v for k, v in model.state_dict().items() if k.startswith("model.vision_tower.")}, "mlp")
    with pytest.raises(ValueError, match="projector 'mlp' is not served"):
        read_mmproj(other)


def test_mmproj_flag_reaches_the_engine_args(tmp_path):
    """``pagedllm serve model.gguf --mmproj file`` (llama-server's flag) sets ``EngineArgs.mmproj``; a
    missing file is named before anything loads."""
    import argparse

    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    from pagedllm.models.gguf_mmproj import with_mmproj
    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_flags(p)
    assert engine_args_from_cli(p.parse_args(["m.gguf", "--mmproj", "mmproj-f16.gguf"])).mmproj == "mmproj-f16.gguf"
    assert engine_args_from_cli(p.parse_args(["m.gguf"])).mmproj is None
    with pytest.raises(FileNotFoundError, match="--mmproj: no file"):
        with_mmproj(tmp_path, tmp_path / "absent.gguf")
