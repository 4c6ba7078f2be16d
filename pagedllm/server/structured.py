"""Reading a request's structured-output fields into one ``StructuredOutputsParams``.

Sources, with OpenAI's and vLLM's names: ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs``, vLLM's older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (+ ``guided_whitespace_pattern``),
and, for chat, a forced tool call (``tool_choice: "required"`` or a named function), which
constrains the answer to calls of the given tools:

* named function: the answer is that function's arguments, a JSON object following its
  ``parameters`` schema;
* ``required``: the answer is a JSON array of one or more ``{"name", "parameters"}`` objects,
  each naming one of the tools and following its schema (vLLM's form), which the ``json``
  tool parser reads.

At most one source per request. Errors are 400s naming the field the request used
(``response_format.json_schema.schema``, ``guided_regex``, ``tools[0].function.parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedllm.server.errors import APIError
from pagedllm.server.protocol import NamedToolChoice
from pagedllm.structured_output.params import StructuredOutputError, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class StructuredRequest:
    """A request's constraint and where it came from.

    Attributes:
        params: the constraint, for ``SamplingParams.structured_outputs``.
        source: the request field errors are reported on.
        forced_tool: ``"required"``, or the forced function's name, or ``None`` (no forced call).
    """

    params: StructuredOutputsParams
    source: str
    forced_tool: str | None = None

    def rename(self, param: str | None, message: str) -> tuple[str | None, str]:
        """An engine error's ``(param, message)`` in the request's terms (``structured_outputs.json``
        becomes ``source``)."""
        if param and param.startswith("structured_outputs") and not self.source.startswith("structured_outputs"):
            return self.source, message.replace(param, self.source, 1)
        return param, message


_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # what a constraint is


def _sources(body) -> list[tuple[str, dict]]:
    found: list[tuple[str, dict]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema: required when type is 'json_schema'",
                           "response_format.json_schema", code="invalid_value")
        schema = rf.json_schema.json_schema
        found.append(("response_format.json_schema.schema",
                      {"json": schema} if schema is not None else {"json_object": True}))
    so = body.structured_outputs
    if so is not None:
        fields = so.model_dump(by_alias=True, exclude={"backend", "disable_fallback"}, exclude_defaults=True)
        if isinstance(fields.get("structural_tag"), dict):
            fields["structural_tag"] = json.dumps(fields["structural_tag"])
        kinds = [k for k in _KINDS if k in fields]
        found.append((f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs", fields))
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            fields = {kind: value}
            if body.guided_whitespace_pattern is not None:
                fields["whitespace_pattern"] = body.guided_whitespace_pattern
            found.append((name, fields))
    return found


def _tool_schema(tool, i: int) -> tuple[dict, str]:
    params = tool.function.parameters
    return (params if params is not None else {"type": "object", "properties": {}},
            f"tools[{i}].function.parameters")


def forced_tool_fields(body) -> tuple[str, dict, str] | None:
    """The constraint of a forced tool call: ``(source, fields, forced)``, or ``None`` when
    ``tool_choice`` forces none.

    Raises:
        APIError: 400 when the named function is not among ``tools``, or ``tools`` is empty.
    """
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        for i, t in enumerate(body.tools or []):
            if t.function.name == name:
                schema, source = _tool_schema(t, i)
                return source, {"json": schema}, name
        raise APIError(400, f"tool_choice: function {name!r} is not among the request's tools", "tool_choice",
                       code="invalid_value")
    if choice != "required":
        return None
    if not body.tools:
        raise APIError(400, "tool_choice: 'required' needs at least one tool in tools", "tool_choice",
                       code="invalid_value")
    options = []
    for i, t in enumerate(body.tools):
        schema, _ = _tool_schema(t, i)
        options.append({"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": schema},
                        "required": ["name", "parameters"], "additionalProperties": False})
    items = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "minItems": 1, "items": items}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return "tools", {"json": schema}, "required"


def structured_request(body, reasoning_end_tag: str | None = None, tools: bool = False) -> StructuredRequest | None:
    """The request's one constraint, or ``None`` for free text.

    Args:
        body: a chat or completion request.
        reasoning_end_tag: the constraint starts after this text (a reasoning parser is on
            and thinking is), else ``None``.
        tools: also read ``tool_choice`` (chat).
    Raises:
        APIError: 400 for two constraints in one request, or one of the wrong shape.
    """
    found = [(s, f, None) for s, f in _sources(body)]
    forced = forced_tool_fields(body) if tools else None
    if forced is not None:
        found.append(forced)
    if not found:
        return None
    # ``structured_outputs`` with options only (``disable_additional_properties``, ...) shapes the
    # one constraint given another way (``response_format``, ``guided_*``, a forced tool call)
    options = [f for s, f, _ in found if s == "structured_outputs" and not set(f).intersection(_KINDS)]
    if options and len(found) == 2:
        found = [(s, {**f, **options[0]}, t) for s, f, t in found if s != "structured_outputs"]
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: only one structured-output constraint per request (also got "
                       f"{found[0][0]})", found[1][0].split(".")[0], code="invalid_value")
    source, fields, forced_tool = found[0]
    try:
        params = StructuredOutputsParams(**fields, reasoning_end_tag=reasoning_end_tag)
    except StructuredOutputError as e:
        param = source if e.param == "structured_outputs" or not source.startswith("structured_outputs") else e.param
        raise APIError(400, str(e).replace(e.param, param, 1), param, code="invalid_value") from None
    return StructuredRequest(params, source, forced_tool)
