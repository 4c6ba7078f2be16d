"""Voxtral Realtime on the ``/v1/realtime`` socket (issue 42): one utterance as one growing stream of
requests (``multimodal_voxtral_realtime.RealtimeStream``), each started once a block of new audio rows
has arrived and the request before it has ended, each the one before it extended (its KV reused from
the prefix cache: what was already heard is never computed again); the commit sends the rest of the
audio with its right padding as the last request. Text deltas are the growing decoded text's new
characters (special tokens, the streaming pads, left out), sent in order by the session's speaker.

Source: vLLM's realtime protocol as documented; the streaming rule is Voxtral Realtime's own (one text
token per 80 ms of audio, the text a fixed delay behind it).
"""

from __future__ import annotations

import asyncio

import numpy as np

from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import random_id

MAX_STREAM_S = 600  # a stream's requests carry the mel frames heard so far (about 5 MB a minute): at most this


class StreamDriver:
    """The requests of one Voxtral Realtime utterance.

    Args:
        serving: the ``OpenAIServingTranscription`` (its engine, tokenizer and context).
        temperature: the session's sampling temperature.
    Raises:
        APIError: 400 naming ``audio`` when the model's features cannot be computed piecewise.
    """

    def __init__(self, serving, temperature: float) -> None:
        from pagedllm.multimodal_voxtral_realtime import RealtimeStream
        llm = serving.llm
        self.serving, self.temperature = serving, temperature
        try:
            self.stream = RealtimeStream(llm.engine.processor.multimodal.processor, llm.plan.cache.block_size)
        except ValueError as e:
            raise APIError(400, str(e), "audio", code="invalid_value") from None
        self.more = asyncio.Event()
        self.final = False
        self.heard = 0
        self.sent = ""  # the text sent as deltas so far

    def append(self, samples: np.ndarray) -> None:
        """Add heard audio (``[n]`` float32 at 16 kHz); the next request starts when a block of rows is in.

        Raises:
            APIError: 400 naming ``audio`` past ``MAX_STREAM_S`` (nothing of this chunk is kept).
        """
        if self.heard + samples.size > MAX_STREAM_S * 16_000:
            raise APIError(400, f"audio: a Voxtral Realtime utterance holds at most {MAX_STREAM_S} s of audio; "
                           "commit it first", "audio", code="invalid_value")
        self.heard += samples.size
        self.stream.append(samples)
        self.more.set()

    def close(self) -> None:
        """No more audio in this utterance: the last request takes the rest."""
        self.final = True
        self.more.set()

    async def run(self, deltas: asyncio.Queue) -> tuple[list[int], int]:
        """Run the utterance's requests one after another, their text deltas into ``deltas`` (then
        ``None``); returns every generated id and the last request's prompt tokens. An end-of-text
        token ends the utterance early; an engine error ends it with an ``error`` event (raised)."""
        serving, n_prompt = self.serving, 0
        try:
            while True:
                await self.more.wait()
                self.more.clear()
                final = self.final
                prompt = await serving.ctx.offload(self.stream.next_request, final)
                if prompt is None:
                    continue
                reason = await self._request(prompt, deltas)
                n_prompt = len(prompt.ids)
                if final or reason == "stop":
                    break
                self.more.set()  # audio that came while the request ran
        finally:
            await deltas.put(None)
        return list(self.stream.generated), n_prompt

    async def _request(self, prompt, deltas: asyncio.Queue) -> str | None:
        """One request of the stream to its end, its text deltas into ``deltas``; returns its finish reason."""
        serving = self.serving
        params = SamplingParams(temperature=self.temperature, max_tokens=None)
        req = await serving.ctx.offload(serving._make, random_id("rt"), prompt, params, "audio", None,
                                        lambda p, m: (p, m))
        reason = None
        with serving.ctx.admission.admit(1):
            gen = serving.llm.generate(req)
            try:
                async for out in gen:
                    self.stream.took(out.outputs[0].token_ids)
                    reason = out.outputs[0].finish_reason or reason
                    text = serving.text_of(self.stream.generated)
                    if text.startswith(self.sent) and len(text) > len(self.sent):  # a split byte pair waits
                        await deltas.put(text[len(self.sent):])
                        self.sent = text
            finally:  # a closed socket cancels the task: the request is aborted now
                await gen.aclose()
        return reason
