"""The server's grammar checks, with the real processor and tokenizer but a scripted engine: a
constraint is checked off the tokenizer thread before anything is queued (issue 35 item 3: a slow
grammar made every other request wait), and a refusal, or a grammar that still fails in the core,
is a 400 naming the field the request used, streamed or not."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pagedllm.engine.processor import Processor
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.server import anthropic, responses
from pagedllm.server.base import HeldStream, ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.completions import OpenAIServingCompletion
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]
BAD = {"type": "strin"}  # llguidance: "Invalid type: strin"


class ScriptedLLM:
    """What the handlers use of ``AsyncLLM``, over a real ``Processor``; each request answers "ok",
    or fails as a grammar failing in the core does when ``core_error`` is set."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.context_limit, self.max_model_len, self.model_dir = tokenizer, 2048, 2048, "m"
        self.is_healthy = True
        self.processor = Processor(tokenizer, 49152, 2048)
        self.core_error: str | None = None
        self.generated = 0

    def default_sampling_fields(self) -> dict:
        return {}

    def check_structured_outputs(self, params) -> None:
        self.processor.check_structured_outputs(params)

    def make_request(self, rid, prompt, params, cache_salt=None):
        return self.processor.process(rid, prompt, params)

    async def generate(self, req):
        self.generated += 1
        out = (CompletionOutput(0, "", [], "error", f"the grammar failed to compile: {self.core_error}")
               if self.core_error else CompletionOutput(0, "ok", [1], "stop"))
        yield RequestOutput(req.request_id, None, req.prompt_token_ids, [out], True)


@pytest.fixture(scope="module")
def llm(smollm2_tokenizer):
    fake = ScriptedLLM(smollm2_tokenizer)
    yield fake
    fake.processor.close()


@pytest.fixture
def chat(llm):
    llm.core_error = None
    return OpenAIServingChat(ServingContext(llm, "m"))


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSGS, max_tokens=4, **kw)


def _refusal(coro) -> APIError:
    with pytest.raises(APIError) as e:
        asyncio.run(coro)
    assert e.value.status == 400
    return e.value


def test_a_slow_grammar_check_does_not_hold_up_other_requests(chat):
    """A grammar of 24,000 alternatives takes over a second to compile; a plain chat sent meanwhile
    is answered at once (before: the check ran on the one tokenizer thread and the plain chat
    waited for it)."""
    grammar = "start: " + " | ".join(f'"c{i}"' for i in range(24_000))

    async def run():
        slow = asyncio.create_task(chat.chat(_chat(guided_grammar=grammar)))
        await asyncio.sleep(0.3)  # the check is under way
        t0 = time.monotonic()
        plain = await chat.chat(_chat())
        waited = time.monotonic() - t0
        return plain, waited, slow.done(), await slow

    plain, waited, slow_done_then, slow = asyncio.run(run())
    assert plain["choices"][0]["message"]["content"] == "ok" and slow["choices"][0]["message"]["content"] == "ok"
    assert not slow_done_then and waited < 0.5, waited


@pytest.mark.parametrize("body,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}),
     "response_format.json_schema.schema"),
    (dict(guided_json=BAD), "guided_json"),
    (dict(guided_grammar="start: start"), "guided_grammar"),  # passed validate_grammar, failed in the core
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD}}],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tools[0].function.parameters"),
])
def test_a_refusal_names_the_field_and_queues_nothing(chat, llm, body, param):
    before = llm.generated
    for stream in (False, True):
        e = _refusal(chat.chat(_chat(stream=stream, **body)))
        assert e.param == param and e.message.startswith(f"{param}: "), (e.param, e.message)
    assert llm.generated == before


def test_the_issues_chain_is_refused_by_the_limits_naming_the_field(chat, llm):
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    defs["d3000"] = {"type": "integer"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    e = _refusal(chat.chat(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                        "schema": schema}})))
    assert e.param == "response_format.json_schema.schema" and "$ref chain is more than 128" in e.message
    completion = OpenAIServingCompletion(ServingContext(llm, "m"))
    e = _refusal(completion.completion(CompletionRequest(model="m", prompt="x", guided_grammar="start: r0\n" + "".join(
        f"r{i}: r{i + 1}\n" for i in range(300)) + 'r300: "a"\n')))
    assert e.param == "guided_grammar" and e.message.startswith("guided_grammar: the grammar's rule references")


def test_responses_and_anthropic_requests_name_their_own_fields(chat):
    req = responses.ResponsesRequest.model_validate({"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": BAD}}})
    e = _refusal(chat.chat(responses.to_chat(req, [])[0]))
    assert e.param == "text.format.schema" and e.message == "text.format.schema: Invalid type: strin"
    req = responses.ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": {
        "type": "function", "name": "f"}, "tools": [{"type": "function", "name": "f", "parameters": BAD}]})
    assert _refusal(chat.chat(responses.to_chat(req, [])[0])).param == "tools[0].parameters"
    msg = anthropic.parse({"model": "m", "max_tokens": 4, "messages": MSGS, "tool_choice": {"type": "tool", "name": "g"},
                           "tools": [{"name": "f", "input_schema": {"type": "object"}},
                                     {"name": "g", "input_schema": BAD}]})
    e = _refusal(chat.chat(anthropic.to_chat(msg)))
    # a tool's schema whose type cannot be an object is refused before it is compiled (issue 36)
    assert e.message == "tools[1].input_schema: a function's parameters must be a JSON schema of type 'object', got type 'strin'"


def test_a_grammar_failing_in_the_core_is_a_400_naming_the_field_streamed_or_not(chat, llm):
    llm.core_error = "Error: None"
    body = dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    for stream in (False, True):
        e = _refusal(chat.chat(_chat(stream=stream, **body)))
        assert e.param == "response_format.json_schema.schema"
        assert e.message == "response_format.json_schema.schema: the grammar failed to compile: Error: None"
    llm.core_error = None

    async def streamed():
        held = await chat.chat(_chat(stream=True, guided_choice=["ok"]))
        assert isinstance(held, HeldStream)
        try:
            return [line async for line in held]
        finally:
            await held.aclose()

    lines = asyncio.run(streamed())
    assert json.loads(lines[1][6:])["choices"][0]["delta"]["content"] == "ok" and lines[-1] == "data: [DONE]\n\n"
