"""The hostile requests of issue 35, each with the statuses a well-behaved server may answer.

Used by ``hostile_soak.py`` (the ``hostile`` phase sends each of them while 50 normal streams
run). Every case is ``(name, method, path, body, expected statuses)``; ``body`` is a dict (sent
as JSON) or bytes (sent as they are). The cases follow the issue's items:

1. constraints that overflowed the grammar compiler's stack: a ``$ref`` chain of 3,000
   definitions through every field that carries a schema, and a Lark grammar of 3,000 chained rules;
2. memory: eight distinct 1,000,000-character ``const`` schemas, Responses with 3.9 MB of ``metadata``;
3. slow constraints: 10,000 grammar alternatives, 1 MB consts, Lark terminals and choice lists;
4. 1,000-deep nesting in a schema, in ``guided_json`` text, in a Responses input item and as a
   whole ``/v1/messages`` body;
5. values past their range: Responses ``temperature: 1e308``, ``include``, ``background``;
   Messages ``top_k: -1``; ``count_tokens`` with an unknown tool; rerank ``top_n: 2**64``;
6. tool schemas with local ``$defs`` under ``tool_choice: "required"`` and Anthropic's ``any`` (served);
9. a method the route does not take (405).
"""

from __future__ import annotations

BAD = {400}
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def ref_chain(n: int = 3000) -> dict:
    """A schema whose ``$ref`` s form a chain of ``n`` definitions ending in an integer."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int = 3000) -> str:
    """A Lark grammar of ``n`` rules, each only the next one."""
    rules = [f"r{i}: r{i + 1}" for i in range(n - 1)] + [f'r{n - 1}: "x"']
    return "start: r0\n" + "\n".join(rules)


def nested(depth: int = 1000, leaf: str = '{"type": "string"}') -> str:
    """JSON text of ``depth`` levels of ``{"a": [...]}`` around the JSON text ``leaf`` (as text:
    ``json.dumps`` itself refuses such depth)."""
    opens = "".join('{"a": ' if i % 2 else "[" for i in reversed(range(depth)))
    closes = "".join("}" if i % 2 else "]" for i in range(depth))
    return opens + leaf + closes


def _raw(prefix: str, inner: str, suffix: str) -> bytes:
    return (prefix + inner + suffix).encode()


def _chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Give me the answer."}], "max_tokens": 8, **kw}


def _tool(schema: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def _defs_tool(name: str, field: str) -> dict:
    """A tool whose schema is what pydantic writes for a nested model (local ``$defs``)."""
    return _tool({"$defs": {"Loc": {"type": "object", "properties": {field: {"type": "string", "maxLength": 12}},
                                    "required": [field], "additionalProperties": False}},
                  "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
                  "additionalProperties": False}, name)


def cases() -> list[tuple[str, str, str, dict | bytes, set[int]]]:
    """Every hostile request of the soak (see the module docstring)."""
    chain, lark = ref_chain(), lark_chain()
    out: list = [
        ("ref chain response_format", "POST", CHAT, _chat(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": chain}}), BAD),
        ("ref chain guided_json", "POST", CHAT, _chat(guided_json=chain), BAD),
        ("ref chain named tool", "POST", CHAT, _chat(tools=[_tool(chain)], tool_choice={
            "type": "function", "function": {"name": "f"}}), BAD),
        ("ref chain responses text.format", "POST", "/v1/responses", {
            "input": "hi", "max_output_tokens": 8, "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": chain}}}, BAD),
        ("ref chain anthropic tool", "POST", MESSAGES, {
            "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": chain}], "tool_choice": {"type": "tool", "name": "f"}}, BAD),
        ("lark chain guided_grammar", "POST", CHAT, _chat(guided_grammar=lark), BAD),
        ("10k alternatives", "POST", CHAT, _chat(guided_grammar="start: " + " | ".join(
            f'"w{i}"' for i in range(10_000))), {200, 400}),
        ("1MB lark terminal", "POST", CHAT, _chat(guided_grammar='start: "' + "a" * 1_000_000 + '"'), BAD),
        ("1MB choice", "POST", CHAT, _chat(guided_choice=[f"c{i}-" + "b" * 100 for i in range(10_000)]), BAD),
        ("deep schema", "POST", CHAT, _raw('{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
                                           '{"type": "object", "properties": {"x": ', nested(), "}}}"), BAD),
        ("deep guided_json text", "POST", CHAT, _chat(guided_json=nested()), BAD),
        ("deep responses input", "POST", "/v1/responses", _raw('{"input": [', nested(1000, '{"type": "message"}'),
                                                               "]}"), BAD),
        ("deep messages body", "POST", MESSAGES, nested(1000, '{"max_tokens": 1}').encode(), BAD),
        ("responses temperature 1e308", "POST", "/v1/responses", {"input": "hi", "temperature": 1e308}, BAD),
        ("responses include", "POST", "/v1/responses", {"input": "hi", "include": ["file_search_call.results"]},
         BAD),
        ("responses background", "POST", "/v1/responses", {"input": "hi", "background": True}, BAD),
        ("messages top_k -1", "POST", MESSAGES, {"max_tokens": 4, "top_k": -1,
                                                  "messages": [{"role": "user", "content": "hi"}]}, BAD),
        ("count_tokens unknown tool", "POST", "/v1/messages/count_tokens", {
            "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "tool", "name": "nope"}}, BAD),
        ("rerank top_n 2**64", "POST", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 2**64}, BAD),
        ("defs under required", "POST", CHAT, _chat(max_tokens=24, tools=[
            _defs_tool("where", "city"), _defs_tool("when", "day")], tool_choice="required"), {200}),
        ("defs under anthropic any", "POST", MESSAGES, {
            "max_tokens": 24, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"},
            "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                      for t in (_defs_tool("where", "city"), _defs_tool("when", "day"))]}, {200}),
        ("405", "PUT", CHAT, _chat(), {405}),
    ]
    for i in range(8):  # distinct on purpose: each would be a new cache entry
        out.append((f"1MB const #{i}", "POST", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"const": f"{i}" + "c" * 1_000_000}}}), BAD))
    big_meta = {f"k{j}": "m" * 4096 for j in range(16)}  # 64 KiB a response: over OpenAI's 512-char values
    for i in range(60):
        out.append((f"metadata #{i}", "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1,
                                                                 "metadata": big_meta}, BAD))
    return out
