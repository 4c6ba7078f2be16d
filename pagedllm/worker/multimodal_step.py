"""The runner's side of images (issue 41): its encoder cache and each step's image rows.

``EncoderCache`` keeps every request's images (from ``NewRequestData.mm_inputs``) and the encoder
outputs the scheduler has not freed, by image hash. ``plan`` turns a step into a ``MultiModalStep``:
the images to encode in this step (the scheduler's ``scheduled_encoder_inputs``) and, for every
scheduled row that is an image placeholder, where its embedding comes from. The step runs on the
execution thread (``model.forward(..., mm=step)``): it encodes its images, embeds the step's tokens
and writes the image rows over their placeholders (``MultiModalStep.embeds``).

An entry is a holder filled when its encoder step runs: a step planned while the step that encodes
its image is still in flight refers to the holder, and a free from the scheduler only drops the
cache's reference, never a step's. The step after which no request reads an image drops its entry
once it has written its rows (``SchedulerOutput.free_encoder_after``); a finished or preempted
request's images are dropped before the next step (``free_encoder_hashes``).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.multimodal_video import retained_index


class EncoderOutput:
    """One image's or video's embeddings, ``[rows, hidden]`` (``value``; ``None`` until its encoder
    step runs), and for a video pruned by EVS which rows of the whole video they are (``kept``:
    ``[rows]`` int64, ascending)."""

    __slots__ = ("value", "kept")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None


class MultiModalStep:
    """The images of one step.

    Attributes:
        encode: ``(holder, MultiModalInput)`` pairs this step encodes first.
        fills: ``(row, holder, first, count)``: flattened rows ``row .. row + count - 1`` take rows
            ``first ..`` of the holder's embeddings.
        adds: as ``fills``, for inputs whose rows are added to the token embeddings
            (``MultiModalInput.additive``: Voxtral Realtime's audio row of every step).
        earlier: a realtime stream's segment hash -> the segments before it in its request (what the
            model's streaming encoder is rebuilt from when it holds no state for the stream).
        drop: ``(cache entries, hash, holder)``: entries to remove once the rows are written (no
            later step reads them), each only while it is still that holder.
        moves: ``(row, holder, first, count, whole)``: the fills of videos pruned by EVS, whose rows take
            the M-RoPE positions ``whole[:, holder.kept[first:first + count]]`` (``whole``: ``[3, n]``
            int64, the whole video's positions in its request; ``positions``).
        deepstack: after ``embeds``, Qwen3-VL's per-layer image rows of the step (``_deepstack``).
    """

    def __init__(self, encode: list, fills: list, drop: list, moves: list | None = None,
                 adds: list | None = None) -> None:
        self.encode, self.fills, self.drop, self.moves, self.adds = encode, fills, drop, moves or [], adds or []
        self.earlier: dict[str, list] = {}
        self.deepstack: tuple[torch.Tensor, torch.Tensor] | None = None  # set by embeds (_deepstack)

    def embeds(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` input embeddings of the step: the token embeddings with the image rows
        written over their placeholders (``model.encode_image``, one call per pixel shape (and extras) for all the
        step's new images; ``model.embed_tokens``).

        Raises:
            RuntimeError: an image's embeddings have another row count than its placeholders.
        """
        x = model.embed_tokens(input_ids)
        width = x.shape[1]  # a wider row carries Qwen3-VL's deepstack rows after its embedding
        groups: dict[tuple, list] = {}  # images of one pixel shape run the vision tower as one batch
        for holder, m in self.encode:
            if m.embeds:  # the client's embeddings (--enable-mm-embeds): no encoder step
                holder.value = m.pixel_values()
                continue
            if "stream" in m.extra:  # a realtime stream's segment: the streaming encoder, in order
                holder.value = model.encode_stream(m, self.earlier[m.hash])
                continue
            groups.setdefault(m.group_key(), []).append((holder, m))
        for (_, names), items in groups.items():
            extra = {k: torch.tensor([m.extra[k] for _, m in items]) for k in names}
            out = model.encode_image(torch.cat([m.pixel_values() for _, m in items]), **extra)
            lengths = [m.rows + m.pruned for _, m in items]
            if out.shape[0] != sum(lengths):
                raise RuntimeError(f"the vision tower gave {out.shape[0]} rows for {sum(lengths)} image placeholders")
            for (holder, m), rows in zip(items, out.split(lengths)):
                holder.value = rows
                if m.pruned:  # EVS: the rows whose embeddings change most from the previous frame's
                    per_step = [n for _, n in m.row_runs()] if m.runs else None  # Qwen3-VL: a count per group
                    holder.kept = retained_index(rows[:, :width], m.extra["video_grid_thw"], m.rows, per_step)
                    holder.value = rows.index_select(0, holder.kept)
        for row, holder, first, count in self.fills:
            x[row:row + count] = holder.value[first:first + count, :width].to(x.dtype)
        for row, holder, first, count in self.adds:
            x[row:row + count] += holder.value[first:first + count].to(x.dtype)
        self.deepstack = self._deepstack(x, width)
        for entries, h, holder in self.drop:
            if entries.get(h) is holder:  # not re-encoded by a step planned since
                del entries[h]
        return x

    def positions(self, pos: torch.Tensor) -> torch.Tensor:
        """``pos`` (``[3, 1, T]`` int64 M-RoPE positions of the step) with each pruned video's rows at
        the positions they had in the whole video (``moves``; after ``embeds``, which picks them)."""
        for row, holder, first, count, whole in self.moves:  # whole on the CPU, kept beside the rows (a GPU)
            pos[:, 0, row:row + count] = whole[:, holder.kept[first:first + count].cpu()].to(pos.device)
        return pos

    def _deepstack(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Qwen3-VL's deepstack: an image row wider than the embeddings carries, after its embedding,
        one more row per early decoder layer (``encode_image``). Returns ``(mask [T] bool of the
        step's image rows, [n, layers * hidden] their extra columns in row order)`` or ``None``."""
        wide = [f for f in self.fills if f[1].value.shape[1] > width]
        if not wide:
            return None
        rows = torch.cat([torch.arange(r, r + c) for r, _, _, c in wide])
        extra = torch.cat([h.value[f:f + c, width:] for _, h, f, c in wide]).to(x.dtype)
        mask = torch.zeros(x.shape[0], dtype=torch.bool)
        mask[rows] = True
        return mask, extra[rows.argsort()]  # the mask selects rows in row order


class EncoderCache:
    """Encoder outputs by image hash, and the images of the requests the runner holds.

    Args:
        rope_index: an M-RoPE model's ``rope_positions`` (``None``: positions stay 1-D).
    Attributes:
        entries: image hash -> ``EncoderOutput``.
        images: request id -> its ``mm_inputs``.
        rope: request id -> ``(positions [3, n] int64, delta, whole)`` of a request with images
            (``rope_index``; ``whole``: offset of each video pruned by EVS -> its whole positions).
    """

    def __init__(self, rope_index=None) -> None:
        self.entries: dict[str, EncoderOutput] = {}
        self.images: dict[str, tuple] = {}
        self.rope_index = rope_index
        self.rope: dict[str, tuple[np.ndarray, int, dict]] = {}

    def update(self, so) -> None:
        """Apply a ``SchedulerOutput``'s frees, finished and new requests."""
        for h in so.free_encoder_hashes:
            self.entries.pop(h, None)
        for rid in so.finished_req_ids:
            self.images.pop(rid, None)
            self.rope.pop(rid, None)
        for nr in so.new_reqs:
            if nr.mm_inputs:
                self.images[nr.req_id] = tuple(nr.mm_inputs)
                if self.rope_index is not None:
                    self.rope[nr.req_id] = self.rope_index(list(nr.token_ids), nr.mm_inputs)

    def rope_positions(self, rids: list[str], start: np.ndarray, n: np.ndarray) -> torch.Tensor | None:
        """``[3, T]`` int64 M-RoPE positions of the step's rows (``None`` when no scheduled request has
        images): token ``p`` of a request with images at its ``rope`` entry's column ``p`` (through its
        last image) or ``p + delta``, every other token at ``p`` on all three axes.

        Args:
            rids: the step's requests in batch order; start: ``[R]`` int64 tokens computed before the
                step; n: ``[R]`` int64 rows each computes.
        """
        if not any(rid in self.rope for rid in rids):
            return None
        out = np.repeat(start - np.concatenate(([0], np.cumsum(n)[:-1])), n) + np.arange(int(n.sum()))
        out = np.repeat(out[None], 3, axis=0)
        row = 0
        for rid, s, k in zip(rids, start.tolist(), n.tolist()):
            if rid in self.rope:
                table, delta, _ = self.rope[rid]
                p = np.arange(s, s + k)
                inside = p < table.shape[1]
                out[:, row:row + k] = np.where(inside, table[:, np.minimum(p, table.shape[1] - 1)], p + delta)
            row += k
        return torch.from_numpy(out)

    def spans(self, rids: list[str], start: np.ndarray, end: np.ndarray,
              whole: bool = False) -> list[tuple[tuple[int, int], ...]]:
        """Per request (batch order), the ``(first, end)`` positions of each placeholder run of its
        images (an image, or each of Gemma 3's pan-and-scan crops) with a placeholder among the tokens
        ``[start, end)`` it computes this step (``AttentionBatch.bidirectional``); ``whole`` (a
        prefix-LM: PaliGemma): one span from the prompt's start through its images' last (the
        processor extends the last image's to the prompt's end)."""
        if whole:
            ends = [max((m.end for m in self.images.get(rid, ())), default=0) for rid in rids]
            return [((0, stop),) if stop > s else () for stop, s in zip(ends, start.tolist())]
        return [tuple((m.offset + a, m.offset + a + n) for m in self.images.get(rid, ()) for a, n in m.row_runs()
                      if m.offset + a < e and m.offset + a + n > s)
                for rid, s, e in zip(rids, start.tolist(), end.tolist())]

    def plan(self, so, rids: list[str], start: np.ndarray, end: np.ndarray, qsl: np.ndarray) -> MultiModalStep | None:
        """The step's ``MultiModalStep`` (``None`` when no scheduled row is an image placeholder).

        Args:
            so: the ``SchedulerOutput``; rids: its requests in batch order; start, end: ``[R]`` int64
                tokens computed before / after the step; qsl: ``[R + 1]`` int64 first rows.
        Raises:
            KeyError: a placeholder row whose image is neither encoded by this step nor cached.
        """
        encode, earlier = [], {}
        for rid, idx in so.scheduled_encoder_inputs.items():
            for i in idx:
                m = self.images[rid][i]
                holder = self.entries[m.hash] = EncoderOutput()
                encode.append((holder, m))
                if "stream" in m.extra:
                    earlier[m.hash] = [x for x in self.images[rid] if "stream" in x.extra and x.offset < m.offset]
        fills, moves, adds = [], [], []
        for i, rid in enumerate(rids):
            whole = self.rope[rid][2] if rid in self.rope else {}
            for m in self.images.get(rid, ()):
                done = 0  # rows of the image before this run (several runs: Idefics3's crops)
                for a, count in m.row_runs():
                    lo, hi = max(m.offset + a, int(start[i])), min(m.offset + a + count, int(end[i]))
                    if lo < hi:
                        dest = adds if m.additive else fills  # Voxtral Realtime: added, not written over
                        dest.append((int(qsl[i]) + lo - int(start[i]), self.entries[m.hash],
                                     done + lo - m.offset - a, hi - lo))
                        if m.offset in whole:
                            moves.append(fills[-1] + (torch.from_numpy(whole[m.offset]),))
                    done += count
        drop = [(self.entries, h, self.entries[h]) for h in so.free_encoder_after if h in self.entries]
        if not (encode or fills or adds):
            return None
        step = MultiModalStep(encode, fills, drop, moves, adds)
        step.earlier = earlier
        return step
