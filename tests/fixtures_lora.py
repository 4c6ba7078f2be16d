"""LoRA fixtures (a plugin of tests/conftest.py: tests/lora and tests/server share them): random PEFT adapters written with ``peft`` and their merged ``transformers`` twins."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch


def write_adapter(hf_model, out: Path, r: int, targets: list[str], seed: int, alpha: int = 16,
                  use_rslora: bool = False):
    """Save a random LoRA adapter of ``hf_model`` (``B`` nonzero: ``init_lora_weights=False``) in ``out``
    and return its merged float32 model (``merge_and_unload``), the reference for greedy tokens."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():  # peft's random B is small: make each adapter change the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(str(out))
    merged = peft_model.merge_and_unload().eval()
    merged.config._name_or_path = ""  # no on-disk reference cache: the base model's key would match
    return merged


@pytest.fixture(scope="session")
def lora_writer():
    """``write_adapter`` as a fixture (test modules import nothing from conftest)."""
    return write_adapter


@pytest.fixture(scope="session")
def smol_adapters(tmp_path_factory, hf_smollm2):
    """Three SmolLM2 adapters: ``{name: (dir, merged model)}`` (ranks 8 and 16, different targets, rsLoRA)."""
    root = tmp_path_factory.mktemp("smol-lora")
    specs = {"attn8": (8, ["q_proj", "v_proj"], 1, False),
             "all16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2, True),
             "mlp8": (8, ["o_proj", "gate_proj", "up_proj", "down_proj"], 3, False)}
    return {name: (root / name, write_adapter(hf_smollm2, root / name, r, t, seed, use_rslora=rs))
            for name, (r, t, seed, rs) in specs.items()}
