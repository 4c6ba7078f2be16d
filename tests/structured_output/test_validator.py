"""The grammar validator's child process (``structured_output/validator.py``) and the processor's
use of it, on SmolLM2's tokenizer: a grammar that crashes the compiler or outlasts the timeout is a
refusal and costs only the child; a grammar ``validate_grammar`` accepts but the core's matcher
refuses (issue 35 item 3's "fails only in the engine") is refused up front."""

from __future__ import annotations

import os
import time

import pytest
from llguidance import LLMatcher

from pagedllm.engine.processor import Processor
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.validator import WALL_TIMEOUT_FACTOR, GrammarValidator

# compiles in a millisecond; its first token mask takes 1-3 s (regex derivatives over 10^6 states)
SLOW_FIRST_MASK = LLMatcher.grammar_from_regex("(a{1000}){1000}")


def chain_spec(n: int) -> str:
    """The issue's ``$ref`` chain as an llguidance spec, past the front end's limits (built directly)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return LLMatcher.grammar_from_json_schema({"$defs": defs, "$ref": "#/$defs/d0"})


@pytest.fixture(scope="module")
def validator(smollm2_tokenizer):
    v = GrammarValidator(smollm2_tokenizer, 49152)
    yield v
    v.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_compiler_crash_is_a_refusal_and_the_child_restarts(validator):
    assert validator.check(LLMatcher.grammar_from_json_schema({"type": "object"})) is None
    pid, restarts = validator.pid, validator.num_restarts
    err = validator.check(chain_spec(3000))  # a SIGSEGV (stack overflow) in the compiler
    assert err in ("too deep or complex to compile: it crashed the grammar compiler (SIGSEGV); simplify it (fewer "
                   f"nested or chained $ref / rule levels)".replace("SIGSEGV", sig) for sig in ("SIGSEGV", "SIGABRT")), err
    assert validator.pid is None and not _alive(pid)
    assert validator.check(LLMatcher.grammar_from_regex("[0-9]+")) is None  # a new child answers
    assert validator.num_restarts == restarts + 1 and validator.pid not in (None, pid)
    assert validator.check(chain_spec(100)) is None


def test_a_timeout_kills_the_child_and_is_a_refusal(smollm2_tokenizer):
    v = GrammarValidator(smollm2_tokenizer, 49152, timeout_s=0.3)
    try:
        assert v.check(LLMatcher.grammar_from_regex("x")) is None
        pid = v.pid
        t0 = time.monotonic()
        err = v.check(SLOW_FIRST_MASK)
        assert time.monotonic() - t0 < 0.3 * WALL_TIMEOUT_FACTOR + 1.0  # CPU-timed; the wall bound backs it
        assert err == ("too complex: compiling it took more than 0.3 s of CPU time; simplify it (fewer alternatives, shorter "
                       "literals and repetitions)")
        assert not _alive(pid)
        assert v.check(LLMatcher.grammar_from_regex("y")) is None
    finally:
        v.close()


def test_grammars_that_validate_grammar_accepts_but_the_core_refuses(validator, smollm2_tokenizer):
    """``start: start`` (no string matches) passes llguidance's ``validate_grammar`` and compiles;
    its first mask fails, and the core then ended the request after one token with ``error``."""
    import llguidance.hf
    ll = llguidance.hf.from_tokenizer(smollm2_tokenizer, n_vocab=49152)
    for lark in ("start: start", 'start: a\na: a "x"'):
        spec = LLMatcher.grammar_from_lark(lark)
        assert LLMatcher.validate_grammar(spec, ll) == ""  # the old front-end check let it through
        err = validator.check(spec)
        assert err == "no output can match it (its first token mask failed: NoExtensionBias)", err
    assert validator.check(LLMatcher.grammar_from_json_schema({"type": "strin"})) == "Invalid type: strin"


def test_the_processor_refuses_with_the_field_and_remembers(smollm2_tokenizer):
    proc = Processor(smollm2_tokenizer, 49152, 2048)
    try:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(grammar="start: start"))
        with pytest.raises(SamplingParamError) as e:
            proc.check_structured_outputs(params)
        assert e.value.param == "structured_outputs.grammar"
        assert str(e.value).startswith("structured_outputs.grammar: no output can match it")
        calls = []
        real = proc._validator.check
        proc._validator.check = lambda spec: calls.append(spec) or real(spec)
        with pytest.raises(SamplingParamError):  # refused from memory: no second compile
            proc.process("r", "hi", params)
        ok = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        proc.check_structured_outputs(ok)
        proc.process("r2", "hi", ok)  # checked once: process finds it valid
        assert len(calls) == 1
    finally:
        proc.close()


def test_a_child_grown_past_its_memory_bound_is_replaced(validator, monkeypatch):
    from pagedllm.structured_output import validator as validator_mod
    assert validator.check(LLMatcher.grammar_from_regex("z+")) is None
    pid = validator.pid
    monkeypatch.setattr(validator_mod, "CHILD_MAX_RSS_BYTES", 1 << 20)  # any child is past 1 MiB
    assert validator.check(LLMatcher.grammar_from_json_schema({"type": "strin"})) == "Invalid type: strin"
    assert validator.pid is None and not _alive(pid)
    monkeypatch.undo()
    assert validator.check(LLMatcher.grammar_from_regex("z+")) is None and validator.pid not in (None, pid)
