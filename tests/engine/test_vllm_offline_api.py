"""vLLM's offline API shapes: prompt types, ``skip_tokenizer_init``, the ``LLM.generate`` / ``LLM.chat``
arguments, and the ``SamplingParams`` fields vLLM scripts set (``detokenize``, ``allowed_token_ids``,
``truncate_prompt_tokens``; ``min_tokens`` holding back stop strings)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from pagedllm import LLM, SamplingParams, TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=64)


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model's directory without any tokenizer file (an RL rollout's or a test's model)."""
    out = tmp_path_factory.mktemp("no-tokenizer") / "model"
    shutil.copytree(tiny_model_dir("llama"), out)
    for f in list(out.iterdir()):
        if "token" in f.name or f.suffix == ".jinja":
            f.unlink()
    return out


def test_every_prompt_shape_gives_the_same_tokens(tiny_llm):
    text = "The capital of France is"
    ids = tiny_llm.get_tokenizer().encode(text)
    shapes = [text, ids, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), {"prompt": text},
              {"prompt_token_ids": ids, "cache_salt": "s"}]
    outs = tiny_llm.generate(shapes, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    assert outs[2].prompt == text and outs[3].prompt is None
    one = tiny_llm.generate(TokensPrompt(prompt_token_ids=ids), GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    engine = tiny_llm.llm_engine  # vLLM's LLMEngine.add_request takes the same prompt shapes
    for i, shape in enumerate(shapes[2:]):
        engine.add_request(f"shape-{i}", shape, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert sorted(done) == [f"shape-{i}" for i in range(4)]
    assert all(t == outs[0].outputs[0].token_ids for t in done.values())


@pytest.mark.parametrize("bad,exc,where", [
    (3.5, TypeError, "prompts[0]"), ({"text": "x"}, ValueError, "prompts[0]"),
    ({"prompt_token_ids": ["a"]}, TypeError, "prompts[0].prompt_token_ids"),
    ({"prompt": 5}, TypeError, "prompts[0].prompt"),
    ({"prompt": "x", "multi_modal_data": {"image": 1}}, TypeError, "prompts[0].multi_modal_data.image[0]"),
])
def test_bad_prompts_name_the_argument(tiny_llm, bad, exc, where):
    with pytest.raises(exc, match=where.replace("[", r"\[").replace("]", r"\]")):
        tiny_llm.generate([bad], GREEDY, use_tqdm=False)
    assert tiny_llm.generate(["ok"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serves


def test_lora_request_needs_enable_lora(tiny_llm):
    """Adapters are served only by an engine built with enable_lora=True (tests/lora)."""
    with pytest.raises(ValueError, match="enable_lora=True"):
        tiny_llm.generate(["x"], GREEDY, lora_request=object())


def test_vllm_style_script_runs_on_a_model_without_tokenizer_files(no_tokenizer_dir, tiny_llm):
    script = textwrap.dedent("""
        import sys
        from pagedllm import LLM, SamplingParams, TokensPrompt
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, num_kv_blocks=64)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
        for out in llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], params, use_tqdm=False):
            print(out.outputs[0].token_ids, repr(out.outputs[0].text))
    """)
    r = subprocess.run([sys.executable, "-c", script, str(no_tokenizer_dir)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    want = tiny_llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], GREEDY, use_tqdm=False)[0]
    assert r.stdout.strip().splitlines()[-1] == f"{want.outputs[0].token_ids} ''"


def test_skip_tokenizer_init_refuses_what_needs_text(no_tokenizer_dir):
    llm = LLM(str(no_tokenizer_dir), skip_tokenizer_init=True, num_kv_blocks=32)
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 6  # detokenize left True: still no text, no error
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["text"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_detokenize_false_gives_ids_only(tiny_llm):
    a = tiny_llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0]
    b = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False),
                          use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids and b.text == "" and a.text


def test_allowed_token_ids_and_truncation(tiny_llm):
    allowed = [100, 200, 300]
    out = tiny_llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True,
                                                      allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    ids = list(range(50, 90))
    cut = tiny_llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                  truncate_prompt_tokens=10), use_tqdm=False)[0]
    whole = tiny_llm.generate([ids[-10:]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-10:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids


def test_min_tokens_holds_back_stop_strings(smollm2_dir):
    """vLLM matches no stop string before min_tokens tokens exist (issue 17's case)."""
    llm = LLM(str(smollm2_dir), num_kv_blocks=64)
    prompt = "The capital city of France is"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    first_nl = free.text.index("\n")  # the model's greedy answer has an early newline
    assert len(llm.get_tokenizer().encode(free.text[:first_nl], add_special_tokens=False)) < 6
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=["\n"], min_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert free.text.startswith(out.text) and len(out.text) > first_nl
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=["\n"]), use_tqdm=False)
    assert plain[0].outputs[0].text == free.text[:first_nl]


def test_chat_arguments(tiny_llm):
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    out = tiny_llm.chat(msgs, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    tok = tiny_llm.get_tokenizer()
    rendered = tok.decode(out.prompt_token_ids)
    assert rendered.rstrip().endswith("Hi, I am")  # the last message stays open
    with pytest.raises(ValueError, match="continue_final_message"):
        tiny_llm.chat(msgs, GREEDY, continue_final_message=True)
    custom = tiny_llm.chat(msgs[:1], GREEDY, chat_template="{% for m in messages %}<<{{ m.content }}>>{% endfor %}",
                           use_tqdm=False)[0]
    assert tok.decode(custom.prompt_token_ids) == "<<Say hi>>"
