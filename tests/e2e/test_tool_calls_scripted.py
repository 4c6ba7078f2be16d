"""Tool calls and reasoning through the real HTTP app and the ``openai`` SDK, with scripted outputs.

One engine serves the whole module, built with a ``ScriptedOutput``
(``pagedllm.worker.scripted``): every request's output is its tokens, then EOS
(the model runner reads the script at each step, so each test sets it before
its request). The tokens are SmolLM2's encoding of the text a tool-using
or reasoning model would emit, so the server's parsers see exactly that text.

One FastAPI app per parser configuration (``build_app(..., reasoning_parser=,
tool_call_parser=, enable_auto_tool_choice=)``) is served by uvicorn in a
background thread, all over the same ``AsyncLLM``. Tests run one request at a
time (the script is shared), non-streamed and streamed.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

MODEL = "smollm2"
NUM_KV_BLOCKS = 256

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
ASK_CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]

PARIS = {"city": "Paris", "unit": "celsius"}
TOKYO = {"tz": "Asia/Tokyo"}
PARIS_JSON = json.dumps(PARIS)  # '{"city": "Paris", "unit": "celsius"}': how every format's script spells them
TOKYO_JSON = json.dumps(TOKYO)
W_NAMED = '{"name": "get_weather", "arguments": ' + PARIS_JSON + '}'
T_NAMED = '{"name": "get_time", "arguments": ' + TOKYO_JSON + '}'
W_PARAMS = '{"name": "get_weather", "parameters": ' + PARIS_JSON + '}'
T_PARAMS = '{"name": "get_time", "parameters": ' + TOKYO_JSON + '}'
WEATHER = ("get_weather", PARIS)
TIME = ("get_time", TOKYO)

# markup of every format that must never show in content
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "```", "<|python_tag|>", "get_weather(",
          "get_time(", '"name"', "<think>", "</think>")

# ---- scripts: (id, tool format, text, expected content, expected calls [(name, args dict)])
ONE_CALL = [
    ("hermes", "hermes", f"<tool_call>\n{W_NAMED}\n</tool_call>", None, [WEATHER]),
    ("hermes-after-text", "hermes", f"Let me check the weather.\n<tool_call>\n{W_NAMED}\n</tool_call>",
     "Let me check the weather.", [WEATHER]),
    ("json", "json", W_NAMED, None, [WEATHER]),
    ("llama3_json", "llama3_json", W_PARAMS, None, [WEATHER]),
    ("mistral", "mistral", f"[TOOL_CALLS][{W_NAMED}]", None, [WEATHER]),
    ("mistral-after-text", "mistral", f"Checking the weather. [TOOL_CALLS][{W_NAMED}]",
     "Checking the weather.", [WEATHER]),
    ("pythonic", "pythonic", '[get_weather(city="Paris", unit="celsius")]', None, [WEATHER]),
    ("hermes-non-ascii", "hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 São Paulo Zürich"}}\n</tool_call>', None,
     [("get_weather", {"city": "東京 São Paulo Zürich"})]),
]
TWO_CALLS = [
    ("hermes", "hermes", f"<tool_call>\n{W_NAMED}\n</tool_call>\n<tool_call>\n{T_NAMED}\n</tool_call>", None,
     [WEATHER, TIME]),
    ("json", "json", f"[{W_NAMED}, {T_NAMED}]", None, [WEATHER, TIME]),
    ("json-fenced", "json", f"```json\n[{W_NAMED}, {T_NAMED}]\n```", None, [WEATHER, TIME]),
    ("llama3_json", "llama3_json", f"<|python_tag|>{W_PARAMS}; {T_PARAMS}", None, [WEATHER, TIME]),
    ("mistral", "mistral", f"[TOOL_CALLS][{W_NAMED}, {T_NAMED}]", None, [WEATHER, TIME]),
    ("mistral-v11", "mistral", f"[TOOL_CALLS]get_weather[ARGS]{PARIS_JSON}[TOOL_CALLS]get_time[ARGS]{TOKYO_JSON}",
     None, [WEATHER, TIME]),
    ("pythonic", "pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(tz="Asia/Tokyo")]', None,
     [WEATHER, TIME]),
]
# answers that are not calls, though some look like the start of one: all content
NOT_CALLS = [
    ("hermes", "Paris is sunny today, 18 degrees."),
    ("hermes", "Tags like <tool_calls> or </tool_call> or <tool are just text."),
    ("json", "Paris is sunny today, 18 degrees."),
    ("json", '{"result": {"name": "x"}}'),
    ("json", "```python\nprint('hi')\n```"),
    ("llama3_json", "Paris is sunny today, 18 degrees."),
    ("llama3_json", '{"answer": 42}'),
    ("mistral", "Paris is sunny today, 18 degrees."),
    ("mistral", "A [TOOL] look-alike, [TOOL_CALL and more."),
    ("pythonic", "Paris is sunny today, 18 degrees."),
    ("pythonic", "[1, 2] is a list."),
]
# prose mentioning the hermes opening tag, never closed and not followed by JSON
UNCLOSED_TAG_PROSE = "Write <tool_call> then the JSON of the call."
FORMATS = ["hermes", "json", "llama3_json", "mistral", "pythonic"]
ONE_BY_FORMAT = {c[1]: c for c in ONE_CALL if c[0] == c[1]}
TWO_BY_FORMAT = {c[1]: c for c in TWO_CALLS if c[0] == c[1]}

THOUGHT = "The user asks for the capital of France."
ANSWER = "The capital of France is Paris."
THINK_ANSWER = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
THINK_CALL = f"<think>\nI need the weather in Paris.\n</think>\n\n<tool_call>\n{W_NAMED}\n</tool_call>"
LONG_THOUGHT = ("<think>\nLet me think about this step by step. The question is about the weather in Paris, "
                "so first I should work out which unit the user prefers, then")

# ---- reasoning cases: (id, reasoning parser, tool parser, script, request extras,
#      expected (reasoning_content, content, calls, finish_reason)); "CUT" = computed from the cut tokens
REASONING = [
    ("qwen3-answer", "qwen3", None, THINK_ANSWER, {}, (THOUGHT, ANSWER, [], "stop")),
    ("deepseek_r1-answer", "deepseek_r1", None, THINK_ANSWER, {}, (THOUGHT, ANSWER, [], "stop")),
    ("deepseek_r1-no-open-tag", "deepseek_r1", None, f"{THOUGHT}\n</think>\n\n{ANSWER}", {},
     (THOUGHT, ANSWER, [], "stop")),
    ("qwen3-no-think-block", "qwen3", None, ANSWER, {}, (None, ANSWER, [], "stop")),
    ("qwen3+hermes-answer", "qwen3", "hermes", THINK_ANSWER, {}, (THOUGHT, ANSWER, [], "stop")),
    ("deepseek_r1+hermes-answer", "deepseek_r1", "hermes", THINK_ANSWER, {}, (THOUGHT, ANSWER, [], "stop")),
    ("qwen3+hermes-call", "qwen3", "hermes", THINK_CALL, {},
     ("I need the weather in Paris.", None, [WEATHER], "tool_calls")),
    ("deepseek_r1+hermes-call", "deepseek_r1", "hermes", THINK_CALL, {},
     ("I need the weather in Paris.", None, [WEATHER], "tool_calls")),
    ("qwen3-thinking-off", "qwen3", None, THINK_ANSWER, {"chat_template_kwargs": {"enable_thinking": False}},
     (None, THINK_ANSWER, [], "stop")),
    ("qwen3+hermes-thinking-off", "qwen3", "hermes", THINK_ANSWER,
     {"chat_template_kwargs": {"enable_thinking": False}}, (None, THINK_ANSWER, [], "stop")),
    ("qwen3-cut", "qwen3", None, LONG_THOUGHT, {"cut": 6}, "CUT"),
    ("deepseek_r1-cut", "deepseek_r1", None, LONG_THOUGHT, {"cut": 6}, "CUT"),
    ("qwen3+hermes-cut", "qwen3", "hermes", LONG_THOUGHT, {"cut": 6}, "CUT"),
    ("deepseek_r1+hermes-cut", "deepseek_r1", "hermes", LONG_THOUGHT, {"cut": 6}, "CUT"),
]

# a Qwen3-style template: the generation prompt opens the reasoning block, or closes an empty one
# when thinking is off, so the output itself has no opening tag
OPENING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
OPENED_THINK_ANSWER = f"{THOUGHT}\n</think>\n\n{ANSWER}"

ALL_SCRIPTS = sorted({c[2] for c in ONE_CALL + TWO_CALLS} | {c[3] for c in REASONING}
                     | {c[1] for c in NOT_CALLS} | {UNCLOSED_TAG_PROSE} | {OPENED_THINK_ANSWER} | {"It is 18 degrees Celsius and sunny in Paris."})


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stack(smollm2_tokenizer, thread_server, tiny_model_dir):
    """One scripted engine and ``AsyncLLM`` for the module; ``url(reasoning, tools, auto)`` serves an app
    of that parser configuration (started on first use); ``script(text)`` sets the next outputs.

    The scripted tokens replace whatever the model draws, so the model is the random tiny Llama with
    SmolLM2's tokenizer and chat template: the same text path at a tenth of the forward cost."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    from pagedllm.worker.scripted import ScriptedOutput

    scripted = ScriptedOutput()
    servers: dict[tuple, object] = {}
    llm = None
    try:
        llm = AsyncLLM(LLMEngine(EngineArgs(model=str(tiny_model_dir("llama")), num_kv_blocks=NUM_KV_BLOCKS),
                                 scripted_output=scripted))

        def url(reasoning: str | None = None, tools: str | None = None, auto: bool = True,
                template: str | None = None) -> str:
            key = (reasoning, tools, auto, template)
            if key not in servers:
                app = build_app(llm, MODEL, template, reasoning_parser=reasoning, tool_call_parser=tools,
                                enable_auto_tool_choice=auto)
                servers[key] = thread_server(app)
            return servers[key].url

        def script(text: str) -> list[int]:
            ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
            assert smollm2_tokenizer.decode(ids) == text, "script text does not survive tokenization"
            scripted.set(ids)  # one reference swap: the engine thread never sees half a script
            return ids

        def app_of(reasoning: str | None = None, tools: str | None = None, auto: bool = True,
                   template: str | None = None):
            url(reasoning, tools, auto, template)
            return servers[(reasoning, tools, auto, template)].server.config.app

        yield SimpleNamespace(llm=llm, url=url, script=script, tokenizer=smollm2_tokenizer, app_of=app_of)
    finally:
        for s in servers.values():
            s.stop()
        if llm is not None:
            llm.shutdown()


_clients: dict[str, openai.OpenAI] = {}


def client(stack, reasoning: str | None = None, tools: str | None = None, auto: bool = True,
           template: str | None = None) -> openai.OpenAI:
    """An SDK client of the app with that configuration (no retries: a 5xx fails at once)."""
    url = stack.url(reasoning, tools, auto, template)
    if url not in _clients:
        _clients[url] = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    return _clients[url]


# ---------------------------------------------------------------- helpers


def reasoning_of(obj) -> str | None:
    """``reasoning_content`` of a message or delta (an extra field for the SDK's models)."""
    return (obj.model_extra or {}).get("reasoning_content")


def summary(resp) -> dict:
    """The comparable fields of a non-streamed response (ids left out; empty text as None)."""
    ch = resp.choices[0]
    m = ch.message
    return {"reasoning_content": reasoning_of(m) or None, "content": m.content or None,
            "tool_calls": [(tc.type, tc.function.name, tc.function.arguments) for tc in m.tool_calls or []],
            "finish_reason": ch.finish_reason}


def collect_stream(stream) -> SimpleNamespace:
    """Read a whole chat stream, checking the tool-call delta shapes on the way.

    Each call's first delta must carry exactly index, id, type ``function`` and
    function name and arguments; every later delta exactly index and function.arguments.
    Returns the concatenations, the pieces in order, the ids and the finish reasons.
    """
    reasoning, content, events, finishes = [], [], [], []
    calls: dict[int, dict] = {}
    chunk_ids = set()
    for chunk in stream:
        chunk_ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        for ch in chunk.choices:
            assert ch.index == 0
            d = ch.delta
            if ch.finish_reason is not None:
                finishes.append(ch.finish_reason)
            r = reasoning_of(d)
            if r:
                reasoning.append(r)
                events.append("reasoning")
            if d.content:
                content.append(d.content)
                events.append("content")
            for tc in d.tool_calls or []:
                raw = tc.model_dump(exclude_unset=True)
                events.append("tool")
                if tc.index not in calls:
                    assert set(raw) == {"index", "id", "type", "function"}, raw
                    assert set(raw["function"]) == {"name", "arguments"}, raw
                    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name, raw
                    assert tc.index == len(calls), f"call {tc.index} opened after {len(calls)} calls"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": [tc.function.arguments]}
                else:
                    assert raw == {"index": tc.index, "function": {"arguments": tc.function.arguments}}, raw
                    calls[tc.index]["args"].append(tc.function.arguments)
    assert len(chunk_ids) == 1, "chunks of one stream must share the id"
    tool_calls = [calls[i] for i in sorted(calls)]
    return SimpleNamespace(
        reasoning="".join(reasoning) or None, content="".join(content) or None,
        reasoning_pieces=reasoning, content_pieces=content, events=events, finishes=finishes,
        ids=[c["id"] for c in tool_calls],
        tool_calls=[("function", c["name"], "".join(c["args"])) for c in tool_calls],
        summary={"reasoning_content": "".join(reasoning) or None, "content": "".join(content) or None,
                 "tool_calls": [("function", c["name"], "".join(c["args"])) for c in tool_calls],
                 "finish_reason": finishes[-1] if finishes else None})


def both(c: openai.OpenAI, **kw):
    """The same request non-streamed and streamed: ``(response, collected stream)``."""
    full = c.chat.completions.create(model=MODEL, temperature=0, **kw)
    streamed = collect_stream(c.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw))
    assert streamed.finishes == [full.choices[0].finish_reason], "exactly one finish_reason, the same"
    assert streamed.summary == summary(full), "streamed and non-streamed disagree"
    return full, streamed


def assert_calls(resp, expected: list[tuple[str, dict]]) -> None:
    """``message.tool_calls`` are the expected (name, arguments) in order, with fresh ``call_`` ids."""
    tcs = resp.choices[0].message.tool_calls or []
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in tcs] == expected
    assert all(tc.type == "function" and tc.id.startswith("call_") for tc in tcs)
    assert len({tc.id for tc in tcs}) == len(tcs), "tool call ids must be distinct"


def error_of(exc: openai.APIStatusError) -> dict:
    """The OpenAI ``error`` object of a failed request."""
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body)


def wait_idle(llm, timeout: float = 10.0) -> dict:
    """Poll ``llm.get_stats()`` until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        s = llm.get_stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle after {timeout} s: {s}")
        time.sleep(0.05)


# ---------------------------------------------------------------- the scripts themselves


@pytest.mark.parametrize("text", ALL_SCRIPTS, ids=range(len(ALL_SCRIPTS)))
def test_script_comes_back_verbatim_without_parsers(stack, text):
    """Without parsers the app answers each script's exact text (so the parsers below see exactly it)."""
    ids = stack.script(text)
    r = client(stack, auto=False).chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=200)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ids) + 1  # the script, then EOS


# ---------------------------------------------------------------- tool calls, every format


@pytest.mark.parametrize("case", ONE_CALL, ids=[c[0] for c in ONE_CALL])
def test_one_call_non_streamed(stack, case):
    """One call: finish_reason tool_calls, a function call with the right name, JSON arguments and a call_ id."""
    _, fmt, text, content, calls = case
    stack.script(text)
    r = client(stack, tools=fmt).chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                                         max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.role == "assistant"
    assert ch.message.content == content
    assert_calls(r, calls)
    assert reasoning_of(ch.message) is None


@pytest.mark.parametrize("case", ONE_CALL, ids=[c[0] for c in ONE_CALL])
def test_one_call_stream_matches_non_stream(stack, case):
    """One call streamed: the same content, name and arguments as the non-streamed answer, no markup in content."""
    _, fmt, text, content, calls = case
    stack.script(text)
    full, s = both(client(stack, tools=fmt), messages=ASK_WEATHER, tools=TOOLS, max_tokens=200)
    assert s.content == content
    assert all(m not in piece for piece in s.content_pieces for m in MARKUP)
    assert len(s.ids) == 1 and s.ids[0].startswith("call_")
    assert s.tool_calls[0][1:] == (full.choices[0].message.tool_calls[0].function.name,
                                   full.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("case", TWO_CALLS, ids=[c[0] for c in TWO_CALLS])
def test_two_parallel_calls_streamed(stack, case):
    """Two calls: indices 0 and 1, distinct ids, first delta names the call, arguments join to the non-streamed ones."""
    _, fmt, text, content, calls = case
    stack.script(text)
    full, s = both(client(stack, tools=fmt), messages=ASK_WEATHER, tools=TOOLS, max_tokens=200)
    assert full.choices[0].finish_reason == "tool_calls"
    assert full.choices[0].message.content == content
    assert_calls(full, calls)
    assert len(s.ids) == 2 and len(set(s.ids)) == 2
    assert [t[1] for t in s.tool_calls] == [n for n, _ in calls]
    assert [t[2] for t in s.tool_calls] == [tc.function.arguments for tc in full.choices[0].message.tool_calls]
    assert s.content is None and not s.reasoning
    for piece in s.content_pieces:
        assert not any(m in piece for m in MARKUP), f"markup in a content delta: {piece!r}"


@pytest.mark.parametrize("case", NOT_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(NOT_CALLS)])
def test_answer_without_calls_is_content(stack, case):
    """An answer that is no call (even one that starts like markup) comes back whole as content, finish_reason stop."""
    fmt, text = case
    stack.script(text)
    full, s = both(client(stack, tools=fmt), messages=ASK_WEATHER, tools=TOOLS, max_tokens=200)
    assert full.choices[0].message.content == text and not full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "stop"
    assert s.content == text and s.tool_calls == []


def test_unclosed_non_json_tool_call_tag_keeps_the_text(stack):
    """A finished answer with an unclosed <tool_call> not followed by JSON keeps its text as content (no call)."""
    stack.script(UNCLOSED_TAG_PROSE)
    full, s = both(client(stack, tools="hermes"), messages=ASK_WEATHER, tools=TOOLS, max_tokens=200)
    assert not full.choices[0].message.tool_calls and full.choices[0].finish_reason == "stop"
    assert full.choices[0].message.content == UNCLOSED_TAG_PROSE


@pytest.mark.parametrize("fmt", FORMATS)
def test_call_cut_by_max_tokens(stack, fmt):
    """A call cut by max_tokens: finish_reason length, a truncated call whose arguments prefix the full ones."""
    _, _, text, _, _ = ONE_BY_FORMAT[fmt]
    ids = stack.script(text)
    full, s = both(client(stack, tools=fmt), messages=ASK_WEATHER, tools=TOOLS, max_tokens=len(ids) - 3)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == len(ids) - 3
    m = full.choices[0].message
    assert not m.content or not any(k in m.content for k in MARKUP)
    for tc in m.tool_calls or []:
        assert tc.function.name == "get_weather"
        assert PARIS_JSON.startswith(tc.function.arguments), tc.function.arguments


# ---------------------------------------------------------------- reasoning


@pytest.mark.parametrize("case", REASONING, ids=[c[0] for c in REASONING])
def test_reasoning(stack, case):
    """Reasoning and answer (or call) apart, streamed as non-streamed; cut reasoning stays reasoning at length."""
    _, rp, tp, text, extra, expected = case
    extra = dict(extra)
    ids = stack.script(text)
    max_tokens = 200
    if "cut" in extra:
        max_tokens = len(ids) - extra.pop("cut")
        cut_text = stack.tokenizer.decode(ids[:max_tokens])
        assert cut_text.startswith("<think>")
        expected = (cut_text[len("<think>"):].strip(), None, [], "length")
    kw = dict(messages=ASK_WEATHER if tp else ASK_CAPITAL, max_tokens=max_tokens)
    if tp:
        kw["tools"] = TOOLS
    if extra:
        kw["extra_body"] = extra
    full, s = both(client(stack, reasoning=rp, tools=tp), **kw)
    want_reasoning, want_content, want_calls, want_finish = expected
    m = full.choices[0].message
    assert "reasoning_content" in (m.model_extra or {}), "a reasoning app always sends reasoning_content"
    assert reasoning_of(m) == want_reasoning
    assert (m.content or None) == want_content
    if want_calls:
        assert m.content is None
    assert_calls(full, want_calls)
    assert full.choices[0].finish_reason == want_finish
    # streamed: the pieces go to their own fields, all reasoning before any content or call
    assert s.reasoning == want_reasoning and s.content == want_content
    kinds = [e for i, e in enumerate(s.events) if i == 0 or e != s.events[i - 1]]
    assert kinds in ([], ["reasoning"], ["content"], ["reasoning", "content"], ["reasoning", "tool"], ["tool"]), kinds
    for piece in s.content_pieces + s.reasoning_pieces:
        if want_content != THINK_ANSWER:  # thinking off: the tags are the answer's own text
            assert "<think>" not in piece and "</think>" not in piece, piece


def test_structured_output_starts_after_the_reasoning(stack):
    """With a reasoning parser, a JSON constraint applies after </think>: free reasoning, then JSON
    (streamed as non-streamed); with thinking off it applies from the first token, and the same
    scripted reasoning text breaks it (the engine ends the request: a 400 naming the field used, guided_json)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    # a real model's "\n\n" after </think> would be masked away (JSON starts with "{"); a script cannot be
    stack.script('<think>Paris, surely.</think>{"city": "Paris"}')
    c = client(stack, reasoning="qwen3")
    full, s = both(c, messages=ASK_CAPITAL, max_tokens=100, extra_body={"guided_json": schema})
    m = full.choices[0].message
    assert reasoning_of(m) == "Paris, surely." and json.loads(m.content) == {"city": "Paris"}
    assert full.choices[0].finish_reason == "stop"
    assert s.reasoning == "Paris, surely." and s.content == m.content
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=ASK_CAPITAL, max_tokens=100, extra_body={
            "guided_json": schema, "chat_template_kwargs": {"enable_thinking": False}})
    assert error_of(e.value)["param"] == "guided_json"  # the request's field (issue 35), not structured_outputs


@pytest.mark.parametrize("rp", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("tp", [None, "hermes"], ids=["no-tools", "hermes"])
def test_reasoning_opened_by_the_prompt(stack, rp, tp):
    """A template whose generation prompt ends in <think>: output without an opening tag is still reasoning."""
    stack.script(OPENED_THINK_ANSWER)
    kw = dict(messages=ASK_CAPITAL, max_tokens=200, **({"tools": TOOLS} if tp else {}))
    full, s = both(client(stack, reasoning=rp, tools=tp, template=OPENING_TEMPLATE), **kw)
    m = full.choices[0].message
    assert (reasoning_of(m), m.content) == (THOUGHT, ANSWER)
    assert full.choices[0].finish_reason == "stop"
    assert (s.reasoning, s.content) == (THOUGHT, ANSWER)


@pytest.mark.parametrize("tp", [None, "hermes"], ids=["no-tools", "hermes"])
def test_thinking_off_with_a_template_that_closes_the_block(stack, tp):
    """enable_thinking false under a template that closes an empty block in the prompt: all output is content."""
    stack.script(ANSWER)
    kw = dict(messages=ASK_CAPITAL, max_tokens=200, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
              **({"tools": TOOLS} if tp else {}))
    full, s = both(client(stack, reasoning="qwen3", tools=tp, template=OPENING_TEMPLATE), **kw)
    assert (reasoning_of(full.choices[0].message), full.choices[0].message.content) == (None, ANSWER)
    assert (s.reasoning, s.content) == (None, ANSWER)


# gpt-oss's harmony output (special tokens in its tokenizer; plain text in SmolLM2's, which keeps it verbatim)
H_ANALYSIS = "<|channel|>analysis<|message|>"
H_FINAL = "<|start|>assistant<|channel|>final<|message|>"
H_CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
HARMONY = [  # (id, tool parser, request extras, script, expected (reasoning, content, calls, finish))
    ("call", "openai", {"tools": TOOLS}, f"{H_ANALYSIS}Need the weather.<|end|>{H_CALL}{PARIS_JSON}",
     ("Need the weather.", None, [WEATHER], "tool_calls")),
    ("answer-no-tools", None, {}, f"{H_ANALYSIS}{THOUGHT}<|end|>{H_FINAL}{ANSWER}", (THOUGHT, ANSWER, [], "stop")),
    ("call-tool-choice-none", "openai", {"tools": TOOLS, "tool_choice": "none"},
     f"{H_ANALYSIS}Need the weather.<|end|>{H_CALL}{PARIS_JSON}", ("Need the weather.", None, [], "stop")),
]


@pytest.mark.parametrize("case", HARMONY, ids=[c[0] for c in HARMONY])
def test_harmony(stack, case):
    """``--reasoning-parser openai_gptoss`` (with ``--tool-call-parser openai`` or none): the analysis is
    reasoning, the final body content, a functions.* message a call; no markup anywhere; streamed as not."""
    _, tp, extra, text, (want_reasoning, want_content, want_calls, want_finish) = case
    stack.script(text)
    full, s = both(client(stack, reasoning="openai_gptoss", tools=tp), messages=ASK_WEATHER, max_tokens=200, **extra)
    m = full.choices[0].message
    assert (reasoning_of(m), m.content or None) == (want_reasoning, want_content)
    assert_calls(full, want_calls)
    assert full.choices[0].finish_reason == want_finish
    assert (s.reasoning, s.content) == (want_reasoning, want_content)
    assert not any("<|" in piece for piece in s.reasoning_pieces + s.content_pieces)


def test_harmony_structured_output_starts_after_the_final_header(stack):
    """A JSON constraint with ``openai_gptoss`` applies after ``<|channel|>final<|message|>``: free analysis
    (its markup included), then the constrained final body; a final body breaking the schema is refused
    (the engine ends the request: a 400 naming guided_json), also when the final message comes first."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    c = client(stack, reasoning="openai_gptoss")
    stack.script(f'{H_ANALYSIS}Paris, surely.<|end|>{H_FINAL}{{"city": "Paris"}}')
    full, s = both(c, messages=ASK_CAPITAL, max_tokens=100, extra_body={"guided_json": schema})
    m = full.choices[0].message
    assert reasoning_of(m) == "Paris, surely." and json.loads(m.content) == {"city": "Paris"}
    assert s.content == m.content
    for text in (f'{H_ANALYSIS}Paris, surely.<|end|>{H_FINAL}{{"city": 1}}', '<|channel|>final<|message|>{"city": 1}'):
        stack.script(text)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK_CAPITAL, max_tokens=100,
                                      extra_body={"guided_json": schema})
        assert error_of(e.value)["param"] == "guided_json"


def test_two_choices_each_parse_their_own_calls(stack):
    """n=2 with tools: each choice has its own two calls (indices 0 and 1 per choice) with ids unique overall."""
    text = TWO_BY_FORMAT["hermes"][2]
    stack.script(text)
    c = client(stack, reasoning="qwen3", tools="hermes")
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200, n=2, temperature=0)
    full = c.chat.completions.create(**kw)
    assert [ch.index for ch in full.choices] == [0, 1]
    ids = []
    for ch in full.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in ch.message.tool_calls] == [WEATHER, TIME]
        ids += [tc.id for tc in ch.message.tool_calls]
    assert len(set(ids)) == 4
    per_choice: dict[int, dict[int, list]] = {0: {}, 1: {}}
    finishes: dict[int, list] = {0: [], 1: []}
    stream_ids = []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
            assert not ch.delta.content and not reasoning_of(ch.delta)
            for tc in ch.delta.tool_calls or []:
                calls = per_choice[ch.index]
                if tc.index not in calls:
                    assert tc.index == len(calls) and tc.id.startswith("call_")
                    stream_ids.append(tc.id)
                    calls[tc.index] = [tc.function.name, tc.function.arguments]
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index][1] += tc.function.arguments
    assert finishes == {0: ["tool_calls"], 1: ["tool_calls"]}
    assert len(set(stream_ids)) == 4
    for i in (0, 1):
        want = [[tc.function.name, tc.function.arguments] for tc in full.choices[i].message.tool_calls]
        assert [per_choice[i][k] for k in sorted(per_choice[i])] == want


# ---------------------------------------------------------------- API rules


def test_streams_of_the_other_apis_release_their_requests(stack):
    """Streamed Messages and Responses answers, read to the end or dropped early, give back their
    admission slots and engine requests (the wrapped chat stream is closed)."""
    stack.script("Paris is the capital of France, a city of many bridges and museums.")
    url, app = stack.url(), stack.app_of()
    body = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "Capital?"}], "stream": True}
    for path, payload in (("/v1/messages", body),
                          ("/v1/responses", {"model": MODEL, "input": "Capital?", "max_output_tokens": 40,
                                             "stream": True})):
        with httpx.stream("POST", url + path, json=payload, timeout=60) as r:
            assert r.status_code == 200
            assert sum(1 for _ in r.iter_lines()) > 5  # read to the end
        with httpx.stream("POST", url + path, json=payload, timeout=60) as r:
            next(r.iter_lines())  # dropped after the first line
    deadline = time.monotonic() + 30
    while app.state.admission.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.admission.in_flight == 0


def test_named_tool_choice_must_name_a_given_tool(stack):
    """A named tool_choice that is not among tools: 400 naming tool_choice (forced calls are
    tested against SmolLM2 in test_structured_outputs.py)."""
    with pytest.raises(openai.BadRequestError) as e:
        client(stack, tools="hermes").chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=20,
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}})
    assert e.value.status_code == 400
    assert error_of(e.value)["param"] == "tool_choice"


@pytest.mark.parametrize("tool_parser", [None, "hermes"], ids=["no-parser", "hermes"])
@pytest.mark.parametrize("choice", ["auto", None], ids=["auto", "default"])
def test_auto_tool_choice_needs_enable_auto_tool_choice(stack, tool_parser, choice):
    """tools with tool_choice auto (or left out) on an app without enable_auto_tool_choice: 400 naming tool_choice."""
    stack.script(ONE_BY_FORMAT["hermes"][2])
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        client(stack, tools=tool_parser, auto=False).chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200, **kw)
    assert e.value.status_code == 400
    assert error_of(e.value)["param"] == "tool_choice"


def test_tool_choice_none_allowed_without_auto(stack):
    """tool_choice none needs no enable_auto_tool_choice: the raw text comes back."""
    text = ONE_BY_FORMAT["hermes"][2]
    stack.script(text)
    r = client(stack, tools="hermes", auto=False).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_tool_choice_none_returns_raw_text(stack, fmt):
    """tool_choice none: no parsing, the call markup comes back verbatim as content, finish_reason stop."""
    text = TWO_BY_FORMAT[fmt][2]
    stack.script(text)
    full, s = both(client(stack, tools=fmt), messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                   max_tokens=200)
    m = full.choices[0].message
    assert m.content == text and not m.tool_calls
    assert full.choices[0].finish_reason == "stop"
    assert s.content == text and s.tool_calls == []


def test_tool_choice_none_still_splits_reasoning(stack):
    """tool_choice none with a reasoning parser: reasoning is split off, the call stays raw content."""
    stack.script(THINK_CALL)
    full, s = both(client(stack, reasoning="qwen3", tools="hermes"), messages=ASK_WEATHER, tools=TOOLS,
                   tool_choice="none", max_tokens=200)
    m = full.choices[0].message
    assert reasoning_of(m) == "I need the weather in Paris."
    assert m.content == f"<tool_call>\n{W_NAMED}\n</tool_call>" and not m.tool_calls
    assert full.choices[0].finish_reason == "stop"


def _follow_up(arguments: str) -> list[dict]:
    return ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc123", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": '{"temperature": 18, "sky": "sunny"}'},
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_follow_up_with_tool_results(stack, fmt):
    """An assistant tool_calls message and its tool result render; the final answer comes back as content."""
    answer = "It is 18 degrees Celsius and sunny in Paris."
    stack.script(answer)
    full, s = both(client(stack, tools=fmt), messages=_follow_up(PARIS_JSON), tools=TOOLS, max_tokens=200)
    assert full.choices[0].message.content == answer and not full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "stop"
    # the tool result is in the rendered prompt
    r = httpx.post(stack.url(None, fmt) + "/tokenize", json={"messages": _follow_up(PARIS_JSON)}, timeout=30)
    assert r.status_code == 200
    assert '{"temperature": 18, "sky": "sunny"}' in stack.tokenizer.decode(r.json()["tokens"])


def test_follow_up_with_non_json_arguments_rejected(stack):
    """An assistant tool call whose arguments are not JSON text: 400 naming messages."""
    stack.script("unused")
    with pytest.raises(openai.BadRequestError) as e:
        client(stack, tools="hermes").chat.completions.create(
            model=MODEL, messages=_follow_up("{city: Paris"), tools=TOOLS, max_tokens=200)
    assert e.value.status_code == 400
    assert error_of(e.value)["param"] == "messages"


# ---------------------------------------------------------------- last: nothing leaked


def test_zz_engine_idle_with_all_blocks_free(stack, assert_no_leaks):
    """After every request above the engine is idle with every KV block free and no request state left."""
    s = wait_idle(stack.llm)
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["num_free_blocks"] == s["num_blocks"] == NUM_KV_BLOCKS
    assert s["num_steps"] > 0
    assert stack.llm.is_healthy
    assert_no_leaks(stack.llm.engine)
