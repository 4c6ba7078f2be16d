"""The streaming parser's contract: every chunking of an output gives the whole-text message.

For every format, a corpus of outputs (plain answer, reasoning then answer,
one call, several calls, calls after text, look-alike tags, multi-byte
characters, unterminated blocks) is fed whole, in chunks of 1, 2, 3, 5 and 8
characters, token by token (SmolLM2's tokenizer), and at random cut points
(hypothesis). Each run must rebuild exactly the whole-text parse, and the
whole-text parse must equal the expected message.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.parsers import make_parser, parse_whole

from parse_runs import run_chunks, whole  # tests/parsers/parse_runs.py

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL2 = '{"name": "get_time", "arguments": {"tz": "Europe/Zürich"}}'
ARGS1 = '{"city": "Paris", "unit": "celsius"}'
ARGS2 = '{"tz": "Europe/Zürich"}'

# (tool parser, reasoning parser, parser kwargs, output text, expected (reasoning, content, [(name, args)]))
CORPUS = [
    # ---- hermes
    ("hermes", None, {}, "The answer is 42.", (None, "The answer is 42.", [])),
    ("hermes", None, {}, f"<tool_call>\n{CALL}\n</tool_call>", (None, None, [("get_weather", ARGS1)])),
    ("hermes", None, {}, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>",
     (None, None, [("get_weather", ARGS1), ("get_time", ARGS2)])),
    ("hermes", None, {}, f"Let me look that up.\n<tool_call>{CALL}</tool_call>",
     (None, "Let me look that up.", [("get_weather", ARGS1)])),
    ("hermes", None, {}, 'Tags like <tool_calls> or </tool_call> or <tool are just text.',
     (None, 'Tags like <tool_calls> or </tool_call> or <tool are just text.', [])),
    ("hermes", None, {}, '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b"}}</tool_call>',
     (None, None, [("echo", '{"text": "a </tool_call> b"}')])),
    ("hermes", None, {}, "Grüße, 東京 🌸 café", (None, "Grüße, 東京 🌸 café", [])),
    ("hermes", None, {}, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
     (None, None, [("get_weather", '{"city": "Par')])),
    ("hermes", None, {}, '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\u00e9\\"}"}</tool_call>',
     (None, None, [("f", '{"a": "é"}')])),
    # ---- reasoning + hermes (Qwen3-style and R1-style)
    ("hermes", "qwen3", {}, f"<think>\nI need the weather.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>",
     ("I need the weather.", None, [("get_weather", ARGS1)])),
    ("hermes", "qwen3", {}, "<think>\nHmm, <tool_call> is not a call here.\n</think>\n\nIt is sunny.",
     ("Hmm, <tool_call> is not a call here.", "It is sunny.", [])),
    # ---- json (Qwen2.5-Coder)
    ("json", None, {}, CALL, (None, None, [("get_weather", ARGS1)])),
    ("json", None, {}, f"[{CALL}, {CALL2}]", (None, None, [("get_weather", ARGS1), ("get_time", ARGS2)])),
    ("json", None, {}, '{"result": {"name": "x"}}', (None, '{"result": {"name": "x"}}', [])),
    # what the real Qwen2.5-Coder-0.5B-Instruct emits for a get_weather tool (greedy)
    ("json", None, {}, '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     (None, None, [("get_weather", '{\n    "city": "Paris"\n  }')])),
    ("json", None, {}, f"```json\n[{CALL}, {CALL2}]\n```\nDone.", (None, "Done.", [("get_weather", ARGS1), ("get_time", ARGS2)])),
    ("json", None, {}, "```python\nprint('hi')\n```", (None, "```python\nprint('hi')\n```", [])),
    ("json", None, {}, '```json\n{"a": 1}\n```', (None, '```json\n{"a": 1}\n```', [])),
    ("json", None, {}, "Sure! Here you go.", (None, "Sure! Here you go.", [])),
    ("json", None, {}, f"{CALL}\n{CALL2}", (None, None, [("get_weather", ARGS1), ("get_time", ARGS2)])),
    ("json", None, {}, f'{CALL}\n{{"note": 1}}', (None, '{"note": 1}', [("get_weather", ARGS1)])),
    ("json", None, {}, '[1, 2, 3]', (None, '[1, 2, 3]', [])),
    ("json", None, {}, '{"name": "get_weather", "arguments": {"city": "São Pau',
     (None, None, [("get_weather", '{"city": "São Pau')])),
    # ---- llama3_json
    ("llama3_json", None, {}, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     (None, None, [("get_weather", '{"city": "Paris"}')])),
    ("llama3_json", None, {}, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     (None, None, [("a", '{"x": 1}'), ("b", "{}")])),
    ("llama3_json", None, {}, "Paris is sunny today.", (None, "Paris is sunny today.", [])),
    # ---- mistral
    ("mistral", None, {}, f"[TOOL_CALLS][{CALL}, {CALL2}]", (None, None, [("get_weather", ARGS1), ("get_time", ARGS2)])),
    ("mistral", None, {}, f"Checking. [TOOL_CALLS][{CALL}]", (None, "Checking.", [("get_weather", ARGS1)])),
    ("mistral", None, {}, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     (None, None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ("mistral", None, {}, "A [TOOL] look-alike, [TOOL_CALL and more.", (None, "A [TOOL] look-alike, [TOOL_CALL and more.", [])),
    # ---- pythonic
    ("pythonic", None, {}, '[get_weather(city="Paris", days=3, metric=True), get_time(tz=\'UTC\')]',
     (None, None, [("get_weather", '{"city": "Paris", "days": 3, "metric": true}'), ("get_time", '{"tz": "UTC"}')])),
    ("pythonic", None, {}, "[1, 2] is a list.", (None, "[1, 2] is a list.", [])),
    ("pythonic", None, {}, '[f(s="a, b) c", n=[1, 2])]', (None, None, [("f", '{"s": "a, b) c", "n": [1, 2]}')])),
    ("pythonic", None, {}, '[get_weather(city="Par', (None, None, [("get_weather", "{")])),
    # ---- reasoning only
    (None, "deepseek_r1", {}, "Let me think. 2+2=4.\n</think>\n\nThe answer is 4.", ("Let me think. 2+2=4.", "The answer is 4.", [])),
    (None, "deepseek_r1", {}, "<think>\nStill thinking when max_tokens hit", ("Still thinking when max_tokens hit", None, [])),
    (None, "deepseek_r1", {"thinking": False}, "No <think> here</think> at all", (None, "No <think> here</think> at all", [])),
    (None, "qwen3", {}, "<think>\n考えています 🤔\n</think>\n\n答え", ("考えています 🤔", "答え", [])),
    (None, "qwen3", {}, "Plain answer without thinking.", (None, "Plain answer without thinking.", [])),
    (None, "qwen3", {"thinking": False}, "<think>x</think>y", (None, "<think>x</think>y", [])),
    (None, "qwen3", {"starts_in_reasoning": True}, "opened by the prompt\n</think>\nanswer", ("opened by the prompt", "answer", [])),
]
IDS = [f"{i}-{c[0]}-{c[1]}" for i, c in enumerate(CORPUS)]


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_whole_text_parse(case):
    """The whole-text parse gives the expected reasoning, content and calls."""
    tp, rp, kw, text, want = case
    assert whole(tp, rp, kw, text) == want


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_fixed_size_chunks(case, size):
    """Chunks of 1, 2, 3, 5 and 8 characters rebuild the whole-text message."""
    tp, rp, kw, text, want = case
    assert run_chunks(tp, rp, kw, [text[i:i + size] for i in range(0, len(text), size)]) == want


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_token_by_token(case, smollm2_tokenizer):
    """Feeding the text as a tokenizer's incremental decode pieces rebuilds the whole-text message."""
    tp, rp, kw, text, want = case
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for i in range(1, len(ids) + 1):
        cur = smollm2_tokenizer.decode(ids[:i])
        if cur.endswith("\ufffd") and i < len(ids):
            continue  # the detokenizer holds split multi-byte characters back
        pieces.append(cur[len(prev):])
        prev = cur
    assert "".join(pieces) == text
    assert run_chunks(tp, rp, kw, pieces) == want


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_cut_points(data):
    """Any cut points rebuild the whole-text message (hypothesis picks the case and the cuts)."""
    tp, rp, kw, text, want = data.draw(st.sampled_from(CORPUS))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0] + cuts + [len(text)]
    assert run_chunks(tp, rp, kw, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == want


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(list('<>/{}[]()"\\:,; =abtnmeoTOLS_CAR|\n') + ["<tool_call>",
       "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", '{"name": "f", "arguments": ',
       '"name"', "é", "🌸", "```json\n", "```", "<|python_tag|>"]), max_size=40).map("".join), tool=st.sampled_from(["hermes", "json", "llama3_json", "mistral", "pythonic"]),
       reasoning=st.sampled_from([None, "deepseek_r1", "qwen3"]), cut=st.integers(1, 7))
def test_arbitrary_text_never_breaks_the_contract(text, tool, reasoning, cut):
    """On arbitrary text built from markup fragments, chunked parsing equals the whole parse, never raises,
    and complete calls carry valid JSON arguments when the model's JSON was valid."""
    want = whole(tool, reasoning, {}, text)
    assert run_chunks(tool, reasoning, {}, [text[i:i + cut] for i in range(0, len(text), cut)]) == want


@pytest.mark.parametrize("case", [c for c in CORPUS if c[4][2]], ids=[i for i, c in zip(IDS, CORPUS) if c[4][2]])
def test_complete_calls_have_valid_json_arguments(case):
    """Arguments of calls that the model closed are valid JSON objects."""
    tp, rp, kw, text, want = case
    for name, args in whole(tp, rp, kw, text)[2]:
        if not text.rstrip().endswith(("Par", "Pau")):
            assert isinstance(json.loads(args), dict), (name, args)


def test_tool_call_tag_in_prose_stays_content():
    """A <tool_call> tag not followed by a JSON object is prose: the text stays whole, closed or not."""
    for text in ("Write <tool_call> then the JSON of the call.", "Use <tool_call>name</tool_call> to call."):
        assert whole("hermes", None, {}, text) == (None, text, [])
        assert run_chunks("hermes", None, {}, list(text)) == (None, text, [])


REQUIRED = '[\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "CET"}}]'


@pytest.mark.parametrize("cut", range(len(REQUIRED) + 1))
def test_forced_calls_never_become_content(cut):
    """``tool_choice: "required"``: every prefix of the constrained array (a cut by max_tokens)
    gives no content, only the calls whose names are complete, each the start of the whole call
    (issue 36: "[\\n\\n{" came back as content); chunked the same as whole."""
    text = REQUIRED[:cut]
    msg = parse_whole(text, forced_calls=True)
    assert not msg.content
    whole = parse_whole(REQUIRED, forced_calls=True).tool_calls
    assert [c.name for c in whole] == ["get_weather", "get_time"]
    for got, want in zip(msg.tool_calls, whole):
        assert got.name == want.name and want.arguments.startswith(got.arguments)
    p = make_parser(forced_calls=True)
    for i in range(0, len(text), 3):
        p.feed(text[i:i + 3])
    p.finish()
    assert [(c.name, c.arguments) for c in p.message.tool_calls] == [(c.name, c.arguments) for c in msg.tool_calls]
    assert not p.message.content
