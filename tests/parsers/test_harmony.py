"""gpt-oss's harmony output through ``openai_gptoss`` (reasoning) and ``openai`` (tool calls).

A corpus of outputs as gpt-oss writes them after a prompt ending in ``<|start|>assistant``
(the final ``<|return|>`` / ``<|call|>`` dropped by the detokenizer, as the engine does), each with
its expected (reasoning, content, calls); each is parsed whole, fed in chunks of 1, 2, 3, 5 and 8
characters and at random cut points (hypothesis), and every run must rebuild exactly the whole
parse. Then the reader's pieces, the strategy without tools, and the server's choices
(special tokens kept, where a constraint starts).
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.parsers import make_parser, parse_whole

import parse_runs  # tests/parsers/parse_runs.py
from pagedllm.parsers.forced import ForcedInMarkup
from pagedllm.parsers.harmony import (GptOssReasoningParser, HarmonyContentParser, HarmonyToolParser,
                                      parse_header, read_messages)

A = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
WEATHER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
TIME = "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
TOKYO = '{"location":"Tokyo"}'
TZ = '{"tz": "Asia/Tokyo"}'
R, T = "openai_gptoss", "openai"

# (reasoning parser, tool parser, parser kwargs, output, expected (reasoning, content, [(name, args)]))
CORPUS = [
    # reasoning then the answer (with and without the final <|return|>)
    (R, T, {}, f"{A}User asks 2+2. Simple.<|end|>{FINAL}2 + 2 = 4.", ("User asks 2+2. Simple.", "2 + 2 = 4.", [])),
    (R, T, {}, f"{A}Simple.<|end|>{FINAL}Four.<|return|>", ("Simple.", "Four.", [])),
    # reasoning then a call, the recipient after the channel (the guide's example)
    (R, T, {}, f"{A}User asks weather. Need call.<|end|>{WEATHER}{TOKYO}",
     ("User asks weather. Need call.", None, [("get_weather", TOKYO)])),
    (R, T, {}, f"{A}Need call.<|end|>{WEATHER}{TOKYO}<|call|>", ("Need call.", None, [("get_weather", TOKYO)])),
    # the recipient in the role header, the content type without <|constrain|>
    (R, T, {}, f"{A}Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
               f"<|message|>{TOKYO}", ("Need weather.", None, [("get_weather", TOKYO)])),
    # the first message's header with its recipient (the prompt gave "<|start|>assistant")
    (R, T, {}, f" to=functions.get_weather<|channel|>commentary json<|message|>{TOKYO}",
     (None, None, [("get_weather", TOKYO)])),
    # two calls
    (R, T, {}, f"{A}Two lookups.<|end|>{WEATHER}{TOKYO}<|call|>{TIME}{TZ}",
     ("Two lookups.", None, [("get_weather", TOKYO), ("get_time", TZ)])),
    # a commentary preamble (content), then a call; <|constrain|> right after the recipient
    (R, T, {}, f"{A}Plan first.<|end|><|start|>assistant<|channel|>commentary<|message|>**Plan**: look up the "
               f"weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|constrain|>json"
               f"<|message|>{TOKYO}", ("Plan first.", "**Plan**: look up the weather.", [("get_weather", TOKYO)])),
    # analysis and commentary interleaved: reasoning joined by newlines, then the answer
    (R, T, {}, f"{A}First thought.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
               f"<|start|>assistant{A}Second thought.<|end|>{WEATHER}{TOKYO}<|call|>",
     ("First thought.\nSecond thought.", "Checking.", [("get_weather", TOKYO)])),
    # cut by max_tokens: inside the analysis, inside a call's JSON, inside a header marker, a body marker
    (R, T, {}, f"{A}Let me think about the wea", ("Let me think about the wea", None, [])),
    (R, T, {}, f'{A}Need call.<|end|>{WEATHER}{{"location":"To',
     ("Need call.", None, [("get_weather", '{"location":"To')])),
    (R, T, {}, f"{A}Thinking.<|end|><|start|>assistant<|chan", ("Thinking.", None, [])),
    (R, T, {}, f"{A}Thinking.<|end|><|sta", ("Thinking.", None, [])),
    (R, T, {}, f"{A}Thinking.<|end|>{WEATHER[:-4]}", ("Thinking.", None, [])),
    (R, T, {}, f"{A}Thinking.<|en", ("Thinking.<|en", None, [])),  # a cut body keeps its text
    # look-alike markers are text
    (R, T, {}, f"{A}Hmm.<|end|>{FINAL}Tags like <|im_start|>, a <|b|> and <|end of line are text.",
     ("Hmm.", "Tags like <|im_start|>, a <|b|> and <|end of line are text.", [])),
    (R, T, {}, "<|im_start|> is a ChatML tag, <| too.", (None, "<|im_start|> is a ChatML tag, <| too.", [])),
    # multi-byte characters
    (R, T, {}, f"{A}考えています 🤔<|end|>{FINAL}東京は晴れ 🌸 café",
     ("考えています 🤔", "東京は晴れ 🌸 café", [])),
    (R, T, {}, f'{A}Zürich?<|end|>{WEATHER}{{"location":"Zürich 🌸"}}',
     ("Zürich?", None, [("get_weather", '{"location":"Zürich 🌸"}')])),
    # no harmony markup at all (e.g. a constrained answer with thinking off)
    (R, T, {}, "The answer is 42.", (None, "The answer is 42.", [])),
    (R, T, {}, '{"location": "Tokyo"}', (None, '{"location": "Tokyo"}', [])),
    # a made-up tool answer (another role) and a header broken before <|message|> are dropped
    (R, T, {}, f'{A}Call.<|end|>{WEATHER}{TOKYO}<|call|><|start|>functions.get_weather to=assistant<|channel|>'
               f'commentary<|message|>{{"sunny": true}}<|end|>', ("Call.", None, [("get_weather", TOKYO)])),
    (R, T, {}, f"{A}Hm.<|end|><|start|>assistant<|end|>{FINAL}Ok.", ("Hm.", "Ok.", [])),
    # without a tool parser (a request without tools): clean content, a call's message dropped
    (R, None, {}, f"{A}Simple.<|end|>{FINAL}Four.", ("Simple.", "Four.", [])),
    (R, None, {}, f"{A}Need call.<|end|>{WEATHER}{TOKYO}", ("Need call.", None, [])),
    (R, None, {}, f"{A}Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Looking.<|end|>{WEATHER}{TOKYO}",
     ("Plan.", "Looking.", [])),
    # thinking off changes nothing: still no markup in the content
    (R, None, {"thinking": False}, f"{A}Simple.<|end|>{FINAL}Four.", ("Simple.", "Four.", [])),
    (R, T, {"thinking": False}, f"{A}Need call.<|end|>{WEATHER}{TOKYO}",
     ("Need call.", None, [("get_weather", TOKYO)])),
    # the tool parser alone: analysis is neither content nor a call
    (None, T, {}, f"{A}Simple.<|end|>{FINAL}Four.", (None, "Four.", [])),
    (None, T, {}, f"{A}Need call.<|end|>{WEATHER}{TOKYO}", (None, None, [("get_weather", TOKYO)])),
    # a forced tool_choice: the final body is the arguments (structured outputs constrain it)
    (R, T, {"forced_function": "get_weather"}, f"{A}Forced.<|end|>{FINAL}{TOKYO}",
     ("Forced.", None, [("get_weather", TOKYO)])),
    (R, None, {"forced_function": "get_weather"}, TOKYO, (None, None, [("get_weather", TOKYO)])),
    (R, None, {"forced_calls": True}, f'{A}Req.<|end|>{FINAL}[{{"name": "get_time", "parameters": {TZ}}}]',
     ("Req.", None, [("get_time", TZ)])),
]
IDS = [f"{i}-{c[0]}-{c[1]}" for i, c in enumerate(CORPUS)]


def run_chunks(rp, tp, kw, chunks) -> tuple:
    """``parse_runs.run_chunks`` with this file's (reasoning, tool) parser order."""
    return parse_runs.run_chunks(tp, rp, kw, chunks)


def whole(rp, tp, kw, text) -> tuple:
    """``parse_runs.whole`` with this file's parser order."""
    return parse_runs.whole(tp, rp, kw, text)


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_whole_text_parse(case):
    """The whole-text parse gives the expected reasoning, content and calls."""
    rp, tp, kw, text, want = case
    assert whole(rp, tp, kw, text) == want


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_fixed_size_chunks(case, size):
    """Chunks of 1, 2, 3, 5 and 8 characters rebuild the whole-text message."""
    rp, tp, kw, text, want = case
    assert run_chunks(rp, tp, kw, [text[i:i + size] for i in range(0, len(text), size)]) == want


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_cut_points(data):
    """Any cut points rebuild the whole-text message (hypothesis picks the case and the cuts)."""
    rp, tp, kw, text, want = data.draw(st.sampled_from(CORPUS))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0] + cuts + [len(text)]
    assert run_chunks(rp, tp, kw, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == want


FRAGMENTS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>",
             "assistant", "analysis", "final", "commentary", " to=functions.f", " to=python", "json", " ",
             "<|", "|>", "<", "x", '{"a": 1}', "é", "🌸", "\n"]


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join),
       parsers=st.sampled_from([(R, T), (R, None), (None, T)]), cut=st.integers(1, 7))
def test_arbitrary_markup_never_breaks_the_contract(text, parsers, cut):
    """On arbitrary text built from harmony fragments, chunked parsing equals the whole parse and never raises."""
    want = whole(*parsers, {}, text)
    assert run_chunks(*parsers, {}, [text[i:i + cut] for i in range(0, len(text), cut)]) == want


def test_no_markup_reaches_content_or_reasoning():
    """Over the corpus's well-formed outputs, neither reasoning nor content holds a harmony marker."""
    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
    for rp, tp, kw, text, _ in CORPUS:
        r, c, _calls = whole(rp, tp, kw, text)
        assert not any(m in (r or "") + (c or "") for m in markers), text


def test_header_fields():
    """Role, channel, recipient and content type, wherever the header puts them."""
    assert parse_header("<|channel|>commentary to=functions.get_weather <|constrain|>json", "assistant") == \
        ("assistant", "commentary", "functions.get_weather", "json")
    assert parse_header("assistant to=functions.f<|channel|>commentary json", None) == \
        ("assistant", "commentary", "functions.f", "json")
    assert parse_header("functions.f to=assistant<|channel|>commentary", None) == \
        ("functions.f", "commentary", "assistant", None)
    assert parse_header("<|channel|>final", "assistant") == ("assistant", "final", None, None)


def test_reader_messages_and_spans():
    """The reader's messages: fields, terminated or not, and spans that cover the text they came from."""
    text = f"{A}Think.<|end|>{WEATHER}{TOKYO}<|call|>{FINAL}Do"
    ms = read_messages(text, final=False)
    assert [(m.channel, m.recipient, m.body, m.terminated) for m in ms] == [
        ("analysis", None, "Think.", True), ("commentary", "functions.get_weather", TOKYO, True),
        ("final", None, "Do", False)]
    assert "".join(text[m.start:m.end] for m in ms) == text
    assert read_messages(f"{A}Think.<|e", final=False)[0].body == "Think."  # may become <|end|>
    assert read_messages(f"{A}Think.<|e", final=True)[0].body == "Think.<|e"
    assert read_messages(f"{A[:-3]}", final=False) == []  # header not complete yet


def test_rest_is_the_markup_of_the_other_messages():
    """``rest`` is the other messages' markup, written out canonically, for the tool parser."""
    split = GptOssReasoningParser().split(f"{A}Think.<|end|>{WEATHER}{TOKYO}", final=True)
    assert split.reasoning == "Think." and split.rest == f"{WEATHER}{TOKYO}"
    split = GptOssReasoningParser().split(f" to=functions.f<|channel|>commentary json<|message|>{{}}<|call|>", True)
    assert split.rest == "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|end|>"


def test_without_tools_the_content_parser_is_used():
    """The named strategy: ``make_parser`` puts the reasoning parser's ``rest_parser`` after it when no tool
    parser is given, wraps a forced parser in it, and leaves the ``<think>`` parsers alone."""
    assert GptOssReasoningParser.rest_parser is HarmonyContentParser
    assert type(make_parser(R).tools) is HarmonyContentParser
    assert type(make_parser(R, T).tools) is HarmonyToolParser
    forced = make_parser(R, T, forced_function="f").tools
    assert isinstance(forced, ForcedInMarkup) and forced.keeps_finish_reason
    assert make_parser("qwen3").tools is None


def test_server_keeps_special_tokens_for_harmony():
    """The chat server keeps special tokens whenever the harmony reasoning parser is on (with or without
    tools) or a tool parser whose markers are special tokens parses the answer."""
    from pagedllm.server.chat import keeps_special_tokens
    assert keeps_special_tokens(R, None) and keeps_special_tokens(R, T) and keeps_special_tokens(None, T)
    assert keeps_special_tokens(None, "mistral") and keeps_special_tokens("qwen3", "llama3_json")
    assert not keeps_special_tokens("qwen3", "hermes") and not keeps_special_tokens(None, None)
    assert not keeps_special_tokens("deepseek_r1", None) and not keeps_special_tokens(None, "json")


@pytest.mark.parametrize("output", [
    [A, "Simple.", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>"],
    ["<|channel|>", "final", "<|message|>"],  # no analysis: the final message comes first
])
def test_structured_output_starts_after_the_final_header(output):
    """The end tag (the final channel's header) switches the grammar on right after it, whether or not
    analysis came first; nothing before it is constrained."""
    from pagedllm.structured_output.manager import GrammarState
    tag = GptOssReasoningParser.end_tag
    assert tag == "<|channel|>final<|message|>"
    fut: Future = Future()
    fut.set_result(None)
    g = GrammarState(fut, tag, decode=lambda ids: output[ids[0]].encode())
    for i in range(len(output)):
        assert not g.active
        assert g.accept(i) is None
    assert g.active
