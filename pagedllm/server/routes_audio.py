"""OpenAI's audio routes for a served Whisper model: ``POST /v1/audio/transcriptions`` and
``POST /v1/audio/translations`` (multipart/form-data; ``server.transcriptions`` answers them), and
vLLM's realtime transcription WebSocket, ``/v1/realtime`` (``server.realtime``).

The form is read here, before the handler runs, so that the disconnect watch of ``server.replies``
(which reads the ASGI channel) never races the upload's body. Errors are OpenAI's error body (400
naming the field, 404 for a model not served, 413 for a body over ``--max-request-body-bytes``, 429
when overloaded, 503 once the engine is gone).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, WebSocket

from pagedllm.media import MAX_AUDIO_BYTES
from pagedllm.server.base import ServingContext
from pagedllm.server.protocol_audio import RESPONSE_FORMATS, read_audio_form
from pagedllm.server.realtime import RealtimeSession
from pagedllm.server.replies import reply
from pagedllm.server.transcriptions import OpenAIServingTranscription

_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}


def _openapi(task: str) -> dict:
    """The operation's request body and 400 in the OpenAPI document (the route reads its own form)."""
    props = {"file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
             "language": {"type": "string", "description": "ISO-639-1 code (detected when left out)"},
             "prompt": {"type": "string"}, "response_format": {"type": "string", "enum": list(RESPONSE_FORMATS)},
             "temperature": {"type": "number", "minimum": 0, "maximum": 1}, "stream": {"type": "boolean"},
             "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["segment"]}}}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                "type": "object", "required": ["file"], "properties": props,
                "description": f"Whisper's {task} request (OpenAI's form; vLLM's sampling fields too)"}}}},
            "responses": {"400": {"description": "Invalid request: the message (and OpenAI's `param`) names the field.",
                                  "content": {"application/json": {"schema": _ERROR}}}}}


def audio_router(ctx: ServingContext) -> APIRouter:
    """The transcription and translation routes.

    Args:
        ctx: what every handler shares (the engine, the served model's name, admission control).
    """
    router = APIRouter()
    serving = OpenAIServingTranscription(ctx)

    @router.post("/v1/audio/transcriptions", openapi_extra=_openapi("transcribe"))
    async def transcriptions(request: Request):
        """OpenAI Create transcription: speech -> text in its language; SSE when ``stream`` is true."""
        form = await read_audio_form(request, MAX_AUDIO_BYTES)
        return await reply(request, serving.create(form, "transcribe"))

    @router.post("/v1/audio/translations", openapi_extra=_openapi("translate"))
    async def translations(request: Request):
        """OpenAI Create translation: speech -> English text (a multilingual Whisper); SSE as vLLM with ``stream``."""
        form = await read_audio_form(request, MAX_AUDIO_BYTES)
        return await reply(request, serving.create(form, "translate"))

    @router.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket):
        """vLLM's realtime transcription: PCM16 audio appended as it arrives, text deltas back."""
        await RealtimeSession(websocket, serving).run()

    return router
