"""The server's pure helpers, without a model: merging choices, deltas, logprob formats, bodies."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.parsers.delta import DeltaMessage, DeltaToolCall
from pagedllm.server.base import Choice, error_event, merge_outputs, sse
from pagedllm.server.chat import delta_out, merge_deltas
from pagedllm.server.logprobs import chat_logprobs, completion_logprobs, tokens_length
from pagedllm.server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatResponseMessage, CompletionChoice,
                                      CompletionResponse, DeltaMessageOut, UsageInfo)


def _out(rid: str, text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, None, [1], [CompletionOutput(0, text, ids, finish)], finish is not None)


async def _gen(rid: str, texts: list[str], delay: float = 0.0, fail: bool = False):
    for k, t in enumerate(texts):
        await asyncio.sleep(delay)
        yield _out(rid, t, [k], "stop" if k == len(texts) - 1 else None)
    if fail:
        raise RuntimeError("engine gone")


def test_merge_outputs_interleaves_by_choice():
    async def run():
        got = [(i, o.outputs[0].text) async for i, o in merge_outputs([_gen("a", ["a1", "a2"], 0.01),
                                                                        _gen("b", ["b1", "b2", "b3"])])]
        return got
    got = asyncio.run(run())
    assert sorted(got) == [(0, "a1"), (0, "a2"), (1, "b1"), (1, "b2"), (1, "b3")]
    assert [t for i, t in got if i == 0] == ["a1", "a2"] and [t for i, t in got if i == 1] == ["b1", "b2", "b3"]


def test_merge_outputs_raises_the_first_error_and_closes_the_rest():
    closed = []

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield _out("c", "x", [0])
        finally:
            closed.append("c")

    async def run():
        with pytest.raises(RuntimeError, match="engine gone"):
            async for _ in merge_outputs([_gen("a", ["a1"], fail=True), endless()]):
                pass
    asyncio.run(run())
    assert closed == ["c"]


def test_choice_accumulates_deltas():
    c = Choice()
    lp = {5: Logprob(-0.5, 1, "He")}
    c.add(RequestOutput("r", None, [1], [CompletionOutput(0, "He", [5], None, None, [lp])]))
    c.add(RequestOutput("r", None, [1], [CompletionOutput(0, "llo", [6, 7], "length", None, [])]))
    assert (c.text, c.num_tokens, c.finish, c.logprobs) == ("Hello", 3, "length", [lp])


def test_merge_deltas_joins_argument_pieces():
    a = DeltaMessage("", "Hi", [DeltaToolCall(0, "call_1", "get", '{"ci')])
    b = DeltaMessage("", "", [DeltaToolCall(0, None, None, 'ty": 1}'), DeltaToolCall(1, "call_2", "put", "")])
    m = merge_deltas(a, b)
    assert m.content == "Hi"
    assert [(t.index, t.id, t.name, t.arguments) for t in m.tool_calls] == [
        (0, "call_1", "get", '{"city": 1}'), (1, "call_2", "put", "")]


def test_delta_out_names_only_what_changed():
    assert delta_out(DeltaMessage("", "x", [])).model_dump() == {"content": "x"}
    assert delta_out(DeltaMessage("think", "", [])).model_dump() == {"reasoning_content": "think"}
    assert delta_out(DeltaMessage()).model_dump() == {}
    assert DeltaMessageOut(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}


def test_response_bodies_keep_openai_shapes():
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[
        ChatChunkChoice(index=0, delta=DeltaMessageOut(content="hi"))])
    assert chunk.model_dump() == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None,
                                               "finish_reason": None, "stop_reason": None}]}
    usage = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=UsageInfo.of(3, 4)).model_dump()
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                         "total_tokens": 7}
    assert ChatResponseMessage(content=None, tool_calls=[{"id": "x"}]).model_dump() == {
        "role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}
    assert ChatResponseMessage(content="a").model_dump() == {"role": "assistant", "content": "a"}
    body = CompletionResponse(id="x", created=2, model="m", choices=[CompletionChoice(index=0, text="t")]).model_dump()
    assert "usage" not in body and body["object"] == "text_completion"
    line = sse(chunk)
    assert line.startswith("data: ") and line.endswith("\n\n") and json.loads(line[6:]) == chunk.model_dump()
    assert json.loads(error_event(RuntimeError("boom"))[6:])["error"]["message"] == "boom"


def test_logprob_formats():
    pos = [{5: Logprob(-0.1, 1, "He"), 9: Logprob(-2.5, 2, "Ha")}, {7: Logprob(float("-inf"), 3, "llo"),
                                                                      8: Logprob(-0.2, 1, "y")}]
    chat = chat_logprobs(pos, 1)
    assert chat["refusal"] is None and [c["token"] for c in chat["content"]] == ["He", "llo"]
    assert chat["content"][0]["top_logprobs"] == [{"token": "He", "logprob": -0.1, "bytes": [72, 101]}]
    assert chat["content"][1]["logprob"] == -9999.0  # JSON has no -Infinity
    cmpl = completion_logprobs(pos, 1, [None], initial_offset=0, first_prompt_text="P")
    assert cmpl["tokens"] == ["P", "He", "llo"] and cmpl["token_logprobs"][0] is None
    assert cmpl["text_offset"] == [0, 1, 3] and cmpl["top_logprobs"][2] == {"y": -0.2, "llo": -9999.0}
    assert tokens_length(cmpl) == 6
