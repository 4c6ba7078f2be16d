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
        ValueError: tool call arguments that are not JSON text, or nested past the recursion limit;
            a content part other than text (``take_media`` reads media parts first).
    """
    out = []
    for i, m in enumerate(messages):
        d = copy.deepcopy(dict(m))
        if isinstance(d.get("content"), list):
            other = [p.get("type") for p in d["content"] if isinstance(p, dict) and p.get("type", "text") != "text"]
            if other:  # never dropped silently: media go through take_media first
                raise ValueError(f"messages[{i}].content: {other[0]!r} parts are not read here (text only)")
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


# content part type -> the modality it carries
_MEDIA_PARTS = {"image_url": "image", "image_pil": "image", "video_url": "video", "input_audio": "audio",
                "audio_url": "audio"}


def _read_part(kind: str, part: dict, where: str, policy, rate: int | None):
    """The image, ``(frames, fps)`` or ``(samples, rate)`` a media part holds (``take_media``)."""
    from pagedllm.media import audio_from_base64, audio_from_url, image_from_url, video_from_url
    if kind == "image_pil":
        return part.get("image_pil")
    if kind == "input_audio":
        return audio_from_base64((part.get("input_audio") or {}).get("data"), where, rate), rate
    url = (part.get(kind) or {}).get("url")
    if kind == "image_url":
        return image_from_url(url, where, policy)
    if kind == "video_url":
        return video_from_url(url, where, policy)
    return audio_from_url(url, where, policy, rate), rate


def take_media(messages: list[dict], placeholders: dict, policy=None,
               audio_rate: int | None = None) -> tuple[list[dict], dict[str, tuple]]:
    """The messages with their image, video and audio parts replaced by the model's placeholders (each on
    a line of its own before the text, in the parts' order, as the chat API renders them), and the
    media in order per modality.

    Parts: OpenAI's ``{"type": "image_url", "image_url": {"url": "data:..."}}`` and ``{"type":
    "input_audio", "input_audio": {"data": base64, "format": "wav"}}``; vLLM's ``{"type": "image_pil",
    "image_pil": PIL.Image}``, ``video_url`` and ``audio_url`` (``media``: videos as ``(frames, fps)``,
    clips as ``(samples, audio_rate)``).

    Args:
        placeholders: ``{"image": str | None, "video": ..., "audio": ...}``: the model's placeholder per
            modality (``None``: it takes none).
    Raises:
        ValueError: a part the model takes no input of, or a URL or data that is not readable (the
            part named).
    """
    out, media = [], {"image": [], "video": [], "audio": []}
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        texts, marks = [], []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in _MEDIA_PARTS:
                texts.append(p)
                continue
            modality, where = _MEDIA_PARTS[kind], f"messages[{i}].content[{j}].{kind}"
            if placeholders.get(modality) is None:
                raise ValueError(f"messages[{i}].content[{j}]: this model " + (
                    f"takes no {modality}" if any(placeholders.values()) else "reads text only"))
            media[modality].append(_read_part(kind, p, where, policy, audio_rate))
            marks.append({"type": "text", "text": placeholders[modality] + "\n"})
        out.append({**m, "content": marks + texts} if marks else m)
    return out, {k: tuple(v) for k, v in media.items()}
