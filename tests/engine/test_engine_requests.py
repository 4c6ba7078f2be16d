"""Engine-level request handling on a tiny random model: limits, chunking off, aborts, leaks."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import PromptTooLongError
from pagedllm.sampling_params import SamplingParamError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=32, block_size=16)


def test_prompt_limits_follow_kv_pool(llm, assert_no_leaks):
    with pytest.raises(PromptTooLongError) as e:
        llm.generate([list(range(10, 10 + 512))], GREEDY, use_tqdm=False)  # 32 blocks x 16 = 512 slots
    assert e.value.param == "prompt"
    assert_no_leaks(llm.engine)


def test_prompt_exactly_filling_the_pool_runs(llm, assert_no_leaks):
    out = llm.generate([list(range(10, 510))], GREEDY, use_tqdm=False)[0]  # 500 + 12 = 512 slots
    assert len(out.outputs[0].token_ids) == 12
    assert_no_leaks(llm.engine)
    with pytest.raises(PromptTooLongError) as e:
        llm.generate([list(range(10, 511))], GREEDY, use_tqdm=False)
    assert e.value.param == "max_tokens"
    assert_no_leaks(llm.engine)


def test_bad_prompt_in_a_batch_releases_the_others(llm, assert_no_leaks):
    with pytest.raises(SamplingParamError):
        llm.generate([[5, 6, 7], [49152]], GREEDY, use_tqdm=False)  # out-of-vocabulary id
    assert_no_leaks(llm.engine)
    with pytest.raises(SamplingParamError):
        llm.generate([[5, 6, 7], []], GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_abort_frees_blocks_mid_generation(llm, assert_no_leaks):
    eng = llm.engine
    eng.add_request("x", list(range(100, 180)), GREEDY)
    eng.add_request("y", list(range(200, 230)), GREEDY)
    eng.step()
    assert eng.kv_cache_manager.num_free_blocks < eng.num_blocks
    eng.abort_request(["x"])
    assert eng.kv_cache_manager.get_block_ids("x") == [] and "x" not in eng.scheduler.requests
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"y"}
    assert_no_leaks(eng)


def test_without_chunked_prefill_same_tokens_and_limit(tiny_model_dir, llm, assert_no_leaks):
    prompts = [list(range(40, 40 + n)) for n in (3, 20, 45)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    unchunked = LLM(str(tiny_model_dir("llama")), num_kv_blocks=32, max_num_batched_tokens=64,
                    enable_chunked_prefill=False)
    outs = unchunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_no_leaks(unchunked.engine)
    # a prompt the step budget can never hold whole is refused instead of waiting forever
    with pytest.raises(PromptTooLongError) as e:
        unchunked.generate([list(range(10, 80))], GREEDY, use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(PromptTooLongError) as e:
        unchunked.generate([list(range(10, 60))], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert e.value.param == "max_tokens"
    assert_no_leaks(unchunked.engine)
