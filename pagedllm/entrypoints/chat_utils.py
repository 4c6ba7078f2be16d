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
            a content part other than text (``take_images`` reads image parts first).
    """
    out = []
    for i, m in enumerate(messages):
        d = copy.deepcopy(dict(m))
        if isinstance(d.get("content"), list):
            other = [p.get("type") for p in d["content"] if isinstance(p, dict) and p.get("type", "text") != "text"]
            if other:  # never dropped silently: images go through take_images first
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


def take_images(messages: list[dict], placeholder: str | None, policy=None,
                video: str | None = None) -> tuple[list[dict], tuple, tuple]:
    """The messages with their image and video parts replaced by the model's placeholders (each on a
    line of its own before the text, in the parts' order, as the chat API renders them), the images
    and the videos in order.

    Image parts: OpenAI's ``{"type": "image_url", "image_url": {"url": "data:..."}}`` and vLLM's
    ``{"type": "image_pil", "image_pil": PIL.Image}``; video parts: vLLM's ``{"type": "video_url",
    "video_url": {"url": ...}}`` (``media.video_from_url``: ``(frames, fps)``), for a model with a
    ``video`` placeholder.

    Raises:
        ValueError: an image part for a text-only model (``placeholder`` is ``None``), a video part for
            a model without ``video``, or a URL that is not readable (the part named).
    """
    from pagedllm.media import image_from_url, video_from_url
    out, images, videos = [], [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        texts, marks = [], []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in ("image_url", "image_pil", "video_url"):
                texts.append(p)
                continue
            mark = video if kind == "video_url" else placeholder
            if mark is None:
                raise ValueError(f"messages[{i}].content[{j}]: this model "
                                 f"{'takes no video' if placeholder is not None else 'reads text only'}")
            url = (p.get(kind) or {}).get("url") if kind != "image_pil" else None
            if kind == "video_url":
                videos.append(video_from_url(url, f"messages[{i}].content[{j}].video_url", policy))
            else:
                images.append(image_from_url(url, f"messages[{i}].content[{j}].image_url", policy)
                              if kind == "image_url" else p.get("image_pil"))
            marks.append({"type": "text", "text": mark + "\n"})
        out.append({**m, "content": marks + texts} if marks else m)
    return out, tuple(images), tuple(videos)
