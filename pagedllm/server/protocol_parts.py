"""The parts of a chat message's content (OpenAI's chat API): text, and images for an image-text model
(issue 41). ``MessagePart`` picks the part's class by its ``type`` (any other type is checked as text,
so its 400 names ``type``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Tag


class ContentPart(BaseModel):
    """A text part of a multi-part message content."""

    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """``image_url`` of an image part: a ``data:`` URL (``detail`` other than ``auto`` is refused: the
    model's own processor sets the resolution)."""

    url: str
    detail: Literal["auto"] | None = None


class ImageUrlPart(BaseModel):
    """An image part (OpenAI's ``image_url``), for an image-text model."""

    type: Literal["image_url"]
    image_url: ImageUrl


def _part_kind(value: Any) -> str:
    # capitalized tags: the error path (``errors._param_path``) leaves them out, as class names; any
    # other type is checked as a text part, so its 400 names ``type``
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "ImageUrlPart" if kind == "image_url" else "ContentPart"


MessagePart = Annotated[Annotated[ContentPart, Tag("ContentPart")] | Annotated[ImageUrlPart, Tag("ImageUrlPart")],
                        Discriminator(_part_kind)]
