"""Request fields pagedllm refuses: OpenAI's and vLLM's fields that would change the answer and are
not implemented get a 400 naming them (read by ``server/protocol.py``'s request bodies)."""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError


def _is_set(v: Any) -> bool:
    return v not in (None, False, [], {}, "")


# Fields of OpenAI's or vLLM's request bodies that pagedllm does not implement and that would
# change the answer: a request that sets one (to a value other than its no-op default) gets a
# 400 naming it, never a silent 200. name -> "is this value a change?"
REFUSED_FIELDS: dict[str, Any] = {
    "use_beam_search": _is_set, "length_penalty": lambda v: v not in (None, 1, 1.0),
    "logits_processors": _is_set, "bad_words": _is_set, "return_tokens_as_token_ids": _is_set,
    "return_token_ids": _is_set, "return_token_offsets": _is_set, "return_prompt_text": _is_set,
    "kv_transfer_params": _is_set, "ec_transfer_params": _is_set, "mm_processor_kwargs": _is_set,
    "media_io_kwargs": _is_set, "vllm_xargs": _is_set, "repetition_detection": _is_set,
    "routed_experts_prompt_start": _is_set, "thinking_token_budget": _is_set, "prompt_embeds": _is_set,
    "functions": _is_set, "function_call": _is_set, "prediction": _is_set, "audio": _is_set,
    "web_search_options": _is_set, "verbosity": _is_set,
    "modalities": lambda v: v not in (None, ["text"]),
}
# refused on one endpoint only: chat's echo (vLLM prepends the last message), completions' suffix
REFUSED_CHAT_FIELDS = {"echo": _is_set}
REFUSED_COMPLETION_FIELDS = {"suffix": _is_set}


def refuse_unsupported(data: Any, table: dict[str, Any]) -> None:
    """Raise a ``unsupported_field`` validation error for the first field of ``table`` that ``data`` sets."""
    if not isinstance(data, dict):
        return
    for name, changes in table.items():
        if name in data and changes(data[name]):
            raise PydanticCustomError("unsupported_field", "not supported by pagedllm (it would change the "
                                      "answer, so it is refused rather than ignored)", {"param": name})
