"""Preparing OpenAI-shaped chat messages for a model's chat template (shared by the server and ``LLM.chat``)."""

from __future__ import annotations

import copy
import json


def prepare_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` as chat templates expect them.

    Content given as a list of text parts is joined into one string, and the
    ``function.arguments`` of assistant tool calls (JSON text in the OpenAI API)
    become dicts: templates write them with ``tojson`` or iterate their items,
    and would otherwise encode the JSON twice (vLLM converts them the same way).

    Raises:
        ValueError: tool call arguments that are not JSON text, or nested past the recursion limit.
    """
    out = []
    for m in messages:
        d = copy.deepcopy(dict(m))
        if isinstance(d.get("content"), list):
            d["content"] = "".join(p.get("text", "") for p in d["content"] if isinstance(p, dict))
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function", {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    raise ValueError("tool call arguments must be JSON text") from None
                except RecursionError:  # nested past Python's recursion limit: the caller's input
                    raise ValueError("tool call arguments are nested too deeply") from None
        out.append(d)
    return out
