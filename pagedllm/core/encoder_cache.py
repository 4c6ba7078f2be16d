"""The scheduler's side of images (issue 41): which images' encoder steps run in a step, under the
encoder budget, and which encoder outputs the runner keeps (its encoder cache, keyed by the image's
content hash).

A step that computes any placeholder token of an image needs that image's embeddings. If no request
holds them, the image is encoded in that step: at most ``budget`` placeholder tokens of images are
encoded per step (vLLM's encoder budget; at least one image always fits), so a step that would need
more stops its chunk before the first image that does not fit (``fit``). An entry is held by the
requests that will still read it and freed when the last of them has computed past its
placeholders (the runner drops it once the step that computes past them has run:
``SchedulerOutput.free_encoder_after``), finishes or is preempted (preemption recomputes it; dropped
before the next step: ``free_encoder_hashes``). A prefix-cache hit that covers an image's
placeholders needs no encoder step.

Source: vLLM's ``EncoderCacheManager`` and encoder budget (their documented behaviour), written here
for our scheduler.
"""

from __future__ import annotations

from pagedllm.request import Request


class EncoderScheduler:
    """Encoder budget and encoder-cache bookkeeping of one scheduler.

    Args:
        budget: placeholder tokens of images encoded per step at most (``max_num_batched_tokens``:
            vLLM's default encoder budget).
        whole_images: never end a chunk inside an image's placeholders (a model whose image tokens
            attend to each other both ways, Gemma 3: each needs the whole image's keys in its step).
    Attributes:
        holders: image hash -> ids of the requests that hold its encoder output.
        step_encoded: image hashes encoded by the step being planned, with their token counts.
        num_encoded: images encoded since the start (``/stats``, tests).
    """

    def __init__(self, budget: int, whole_images: bool = False) -> None:
        self.budget, self.whole_images = budget, whole_images
        self.holders: dict[str, set[str]] = {}
        self.step_encoded: dict[str, int] = {}
        self._freed: list[str] = []
        self.num_encoded = 0

    def begin_step(self) -> list[str]:
        """Start planning a step; returns the hashes freed since the last one (for the runner)."""
        self.step_encoded = {}
        freed, self._freed = self._freed, []
        return freed

    def _needed(self, req: Request, start: int, end: int):
        """The request's images with a placeholder in ``[start, end)`` (prompt order)."""
        return [m for m in req.mm_inputs if m.offset < end and m.end > start]

    def fit(self, req: Request, n: int) -> int:
        """``n`` cut so that the images this request's next ``n`` tokens need fit the step's encoder
        budget (0 when the first image they need does not); with ``whole_images``, also cut before an
        image the chunk would end inside (0 when the chunk starts inside it: the next step, with
        more of the token budget, takes it whole; the processor refuses an image longer than that)."""
        if not req.mm_inputs or n <= 0:
            return n
        start = req.num_computed_tokens
        used = sum(self.step_encoded.values())
        for m in self._needed(req, start, start + n):
            if self.whole_images and m.end > start + n:
                return max(0, m.offset - start)
            if m.hash in self.holders or m.hash in self.step_encoded:
                continue
            if used + m.length > self.budget and used:  # one image always fits an empty budget
                return max(0, m.offset - start)
            used += m.length
        return n

    def schedule(self, req: Request, n: int) -> list[int]:
        """Take the images ``req``'s next ``n`` tokens need (after ``fit``); returns the indices (into
        ``req.mm_inputs``) of those this step encodes."""
        start = req.num_computed_tokens
        encode = []
        for i, m in enumerate(req.mm_inputs):
            if not (m.offset < start + n and m.end > start):
                continue
            if m.hash not in self.holders and m.hash not in self.step_encoded:
                self.step_encoded[m.hash] = m.length
                self.num_encoded += 1
                encode.append(i)
            self.holders.setdefault(m.hash, set()).add(req.request_id)
        return encode

    def computed(self, req: Request) -> list[str]:
        """Drop ``req``'s hold on the images it has computed past (after its step is planned); returns
        the hashes nobody holds any more (the runner drops them after that step)."""
        # an additive input (Voxtral Realtime's audio rows) covers the whole sequence, whose last token is
        # sampled, never computed (unless the audio goes on: open): its hold ends with the last position computed
        return [m.hash for m in req.mm_inputs if m.end - (m.additive and not m.open) <= req.num_computed_tokens
                and self._drop(m.hash, req.request_id)]

    def release(self, req: Request) -> None:
        """Drop every hold of ``req`` (finished or preempted); what nobody holds any more is freed
        before the next step (``begin_step``)."""
        self._freed += [m.hash for m in req.mm_inputs if self._drop(m.hash, req.request_id)]

    def _drop(self, h: str, rid: str) -> bool:
        """Drop ``rid``'s hold on ``h``; whether that was the last one."""
        holders = self.holders.get(h)
        if holders is None or rid not in holders:
            return False
        holders.discard(rid)
        if holders:
            return False
        del self.holders[h]
        return True
