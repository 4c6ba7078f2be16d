"""vLLM's offline prompt types: ``TextPrompt`` and ``TokensPrompt`` (``vllm.inputs``), and the one
function that reads any accepted prompt shape.

A prompt is a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [int]}``
(either dict may carry ``cache_salt``); a ``TextPrompt`` may carry ``multi_modal_data`` (images, for
an image-text model: ``multimodal_inputs.MultiModalPrompt``).
"""

from __future__ import annotations

from typing import Any, TypedDict, Union

from typing_extensions import NotRequired  # typing has it from 3.11 only; pydantic requires this package

_REFUSED_KEYS = ("mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")


class TextPrompt(TypedDict):
    """A text prompt (vLLM's ``TextPrompt``): ``prompt``, and optionally ``cache_salt`` and
    ``multi_modal_data`` (``{"image": PIL.Image | [PIL.Image, ...]}``)."""

    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict]


class TokensPrompt(TypedDict):
    """A token-id prompt (vLLM's ``TokensPrompt``): ``prompt_token_ids``, optionally ``prompt`` (its
    text, reported back in ``RequestOutput.prompt``) and ``cache_salt``."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_prompt(prompt: Any, where: str = "prompts") -> tuple[str | list[int], str | None, str | None]:
    """Read one prompt of any accepted shape.

    Args:
        prompt: a ``PromptType``.
        where: the argument's name, for errors (``prompts[3]``).
    Returns:
        ``(prompt, text, cache_salt)``: what to tokenize (a string) or the ids, the prompt's text
        when known, and the prefix-cache salt.
    Raises:
        TypeError: not one of the accepted shapes (the message names ``where``).
        ValueError: a dict with multimodal keys, or with neither or both of ``prompt`` and
            ``prompt_token_ids`` in a way vLLM does not accept.
    """
    from pagedllm.multimodal_inputs import MultiModalPrompt, read_media
    if isinstance(prompt, str):
        return prompt, prompt, None
    if isinstance(prompt, MultiModalPrompt):  # already read (LLM.generate, then LLMEngine.add_request)
        return prompt, prompt.text, None
    if _is_token_ids(prompt):
        return list(prompt), None, None
    if not isinstance(prompt, dict):
        raise TypeError(f"{where}: expected a str, a list of token ids, a TextPrompt or a TokensPrompt dict, "
                        f"got {type(prompt).__name__}")
    refused = [k for k in _REFUSED_KEYS if prompt.get(k) is not None]
    if refused:
        raise ValueError(f"{where}: {refused[0]} is not supported (pagedllm serves text-only models)")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"{where}.cache_salt: expected a str, got {type(salt).__name__}")
    if "prompt_token_ids" in prompt:
        if prompt.get("multi_modal_data") is not None:
            raise ValueError(f"{where}.multi_modal_data: give images with a text prompt (its image tokens are "
                             "expanded by the model's processor), not with prompt_token_ids")
        ids = prompt["prompt_token_ids"]
        if not _is_token_ids(ids):
            raise TypeError(f"{where}.prompt_token_ids: expected a list of ints")
        text = prompt.get("prompt")
        return list(ids), text if isinstance(text, str) else None, salt
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"{where}.prompt: expected a str, got {type(prompt['prompt']).__name__}")
        if prompt.get("multi_modal_data") is not None:
            images, videos, audios = read_media(prompt["multi_modal_data"], where)
            return MultiModalPrompt(prompt["prompt"], images, videos=videos, audios=audios), prompt["prompt"], salt
        return prompt["prompt"], prompt["prompt"], salt
    raise ValueError(f"{where}: a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt), "
                     f"got keys {sorted(prompt)}")
