"""The parts of a chat message's content (OpenAI's chat API): text, and images (or their embeddings:
vLLM's ``image_embeds``) for an image-text model (issue 41), videos (``video_url``) for a video-text
model, audio (``input_audio``, ``audio_url``) for an audio-text model (issue 42). ``MessagePart`` picks
the part's class by its ``type`` (any other type is checked as text, so its 400 names ``type``)."""

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


class ImageEmbedsPart(BaseModel):
    """An image given as its embeddings (vLLM's ``image_embeds``: base64 of ``torch.save`` of a float
    ``[rows, hidden]`` tensor), for a server started with ``--enable-mm-embeds``."""

    type: Literal["image_embeds"]
    image_embeds: str


class VideoUrl(BaseModel):
    """``video_url`` (``audio_url``) of a video (audio) part: a ``data:...;base64,`` URL, or a
    ``file://`` / http(s) URL as ``--allowed-local-media-path`` / ``--allowed-media-domains`` allow."""

    url: str


class VideoUrlPart(BaseModel):
    """A video part (vLLM's ``video_url``), for a video-text model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""

    type: Literal["video_url"]
    video_url: VideoUrl


class InputAudio(BaseModel):
    """``input_audio`` of an audio part: base64 of an audio file, and its format."""

    data: str
    format: Literal["wav", "mp3", "flac", "ogg", "m4a", "webm"] | None = None


class InputAudioPart(BaseModel):
    """An audio part (OpenAI's ``input_audio``), for an audio-text model (Qwen2-Audio); the file is
    decoded by PyAV whatever ``format`` says."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioUrlPart(BaseModel):
    """An audio part given by URL (vLLM's ``audio_url``: ``data:``, or ``file://`` / http(s) as the
    media flags allow)."""

    type: Literal["audio_url"]
    audio_url: VideoUrl


AUDIO_PARTS = (InputAudioPart, AudioUrlPart)
_PART_TAGS = {"image_url": "ImageUrlPart", "image_embeds": "ImageEmbedsPart", "video_url": "VideoUrlPart",
              "input_audio": "InputAudioPart", "audio_url": "AudioUrlPart"}


def _part_kind(value: Any) -> str:
    # capitalized tags: the error path (``errors._param_path``) leaves them out, as class names; any
    # other type is checked as a text part, so its 400 names ``type``
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _PART_TAGS.get(kind, "ContentPart")


MessagePart = Annotated[Annotated[ContentPart, Tag("ContentPart")] | Annotated[ImageUrlPart, Tag("ImageUrlPart")]
                        | Annotated[ImageEmbedsPart, Tag("ImageEmbedsPart")]
                        | Annotated[VideoUrlPart, Tag("VideoUrlPart")]
                        | Annotated[InputAudioPart, Tag("InputAudioPart")]
                        | Annotated[AudioUrlPart, Tag("AudioUrlPart")], Discriminator(_part_kind)]
