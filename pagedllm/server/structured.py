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
from pagedllm.server.tool_schema import place_tool_schemas
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
_NAMES = "_structured_names"  # on a chat body translated from another API: chat field -> that API's


def name_fields(body, names: dict[str, str]) -> None:
    """Have a chat body translated from another API name its constraint's errors in that API's terms.

    Args:
        body: the ``ChatCompletionRequest`` built from a Responses or Anthropic request.
        names: chat fields a constraint may come from (``response_format.json_schema.schema``,
            ``tools[0].function.parameters``) -> the request's own (``text.format.schema``,
            ``tools[0].input_schema``).
    """
    setattr(body, _NAMES, dict(names))  # a private attribute: pydantic neither validates nor dumps it


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
    """A tool's parameter schema as the constraint of its arguments, and the field it came from.

    A function's arguments are a JSON object whatever its schema leaves out (OpenAI's rule): no
    schema or ``{}`` is a function of no arguments (``{}``, as OpenAI reads a left-out
    ``parameters``), and a schema without ``type`` gets ``"type": "object"``.

    Raises:
        APIError: 400 naming the field when the schema's ``type`` cannot be an object.
    """
    params, source = tool.function.parameters, f"tools[{i}].function.parameters"
    if not params:  # left out or {}: a function of no arguments (OpenAI's reading), so always {}
        return {"type": "object", "properties": {}}, source
    kind = params.get("type") if isinstance(params, dict) else None
    if not isinstance(params, dict) or (kind is not None and kind != "object"
                                        and not (isinstance(kind, list) and "object" in kind)):
        raise APIError(400, f"{source}: a function's parameters must be a JSON schema of type 'object', got "
                       f"type {kind!r}", source, code="invalid_value")
    return ({**params, "type": "object"} if kind != "object" else params), source


def forced_tool_fields(body) -> tuple[str, dict, str] | None:
    """The constraint of a forced tool call: ``(source, fields, forced)``, or ``None`` when
    ``tool_choice`` forces none.

    Under ``required`` the tools' schemas share one document: each with local ``$ref``s sits in its
    root's ``$defs`` (``__tool<i>``) with its pointers rewritten (``tool_schema.place_tool_schemas``),
    so its own ``$defs`` and recursive references resolve; the request's schemas are not mutated.

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
    # a tool schema with local $refs ("#/$defs/Loc", pydantic's nested models) moves under the
    # combined root's $defs, its pointers rewritten, so they still resolve (server/tool_schema.py)
    placed, defs = place_tool_schemas([_tool_schema(t, i)[0] for i, t in enumerate(body.tools)])
    options = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": params},
                "required": ["name", "parameters"], "additionalProperties": False}
               for t, params in zip(body.tools, placed)]
    items = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "minItems": 1, "items": items}
    if defs:
        schema["$defs"] = defs
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
    names = getattr(body, _NAMES, None) or {}
    try:
        forced = forced_tool_fields(body) if tools else None
    except APIError as e:  # a tool's schema at fault: in the names of the API the request came in
        if e.param not in names:
            raise
        raise APIError(400, e.message.replace(e.param, names[e.param], 1), names[e.param], code=e.code) from None
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
    source = names.get(source, source)
    try:
        params = StructuredOutputsParams(**fields, reasoning_end_tag=reasoning_end_tag)
    except StructuredOutputError as e:
        param = source if e.param == "structured_outputs" or not source.startswith("structured_outputs") else e.param
        raise APIError(400, str(e).replace(e.param, param, 1), param, code="invalid_value") from None
    return StructuredRequest(params, source, forced_tool)
