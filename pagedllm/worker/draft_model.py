"""``draft_model`` speculation: a smaller model with the target's vocabulary proposes the drafts.

The draft model is loaded with the target's loader (``models/load.load_model``; the target's
dtype and device) and runs through the same paged machinery as the target, in a KV pool of its
own: a ``core/block_pool.BlockPool`` of ``draft_num_kv_blocks`` blocks (default: as many as the
target's pool), head-major K/V tensors per layer as ``worker/model_runner.py`` allocates them,
per request a block table, and the model's attention backend building each forward's metadata
from an ``AttentionBatch`` (block tables and slot mapping). There is no contiguous per-sequence
cache and no second model implementation.

Per request the proposer keeps the tokens whose K/V its cache holds. On ``propose``:

1. roll back to the longest prefix of the request's committed tokens that the cache holds (the
   drafts the target rejected are dropped) and trim or grow its block table to the blocks this
   step needs (``len(tokens) + k - 1`` tokens). When the pool is short, the caches of requests
   outside this step's batch (preempted, waiting, at depth 0) are freed first, least recently
   drafted first (they are recomputed when they next draft); a request whose blocks the pool
   still cannot give gets no drafts this step (nothing fails);
2. run the committed tokens the cache lacks (a new prompt, or the target's accepted and bonus
   tokens) through the draft, batched over the requests in forwards of at most
   ``max_num_batched_tokens`` tokens; the last row of each gives its first draft;
3. ``k - 1`` decode forwards batched over the requests still drafting, each feeding the
   previous draft.

A greedy request's drafts are the draft's argmax: deterministic proposals, which
``worker/spec_verify.py`` verifies as point masses (token for token the target's greedy output).
A sampled request's drafts are draws from ``q``, its temperature / top-k / top-p / min-p applied to
the draft's logits (``Sampler.target_probs``; seeded at the output position for a seeded request),
and ``q`` goes with them to verification (``SchedulerOutput.spec_draft_probs``): keep with
probability ``min(1, p(d) / q(d))``, on a rejection draw from ``max(p - q, 0)`` renormalised, so
the output keeps the target's distribution and a draft close to the target keeps about
``sum(min(p, q))`` of its drafts (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"). ``q`` leaves out penalties, ``logit_bias`` and the ``min_tokens`` ban
(``p`` has them): that costs acceptance, never exactness.
Config keys follow vLLM's ``speculative_config`` (``method: draft_model``, ``model``,
``num_speculative_tokens``, ``quantization``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionBatch
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.spec_decode.config import SpeculativeConfig, TargetInfo
from pagedllm.spec_decode.proposers import ProposeItem

logger = logging.getLogger(__name__)

STEP_DECAY = 0.8  # weight of the past in the measured seconds per draft forward


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _DraftSeq:
    """One request's draft cache: its blocks and the tokens whose K/V they hold (in order)."""

    __slots__ = ("blocks", "cached", "committed")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.cached: list[int] = []   # token at position i has its K/V in the cache
        self.committed = 0            # committed tokens seen by the last propose (never change)


def _tokenizer_vocab(directory: str | None) -> dict[str, int] | None:
    """The ``tokenizer.json`` vocabulary of ``directory`` (token string -> id), ``None`` without one."""
    if directory is None or not (Path(directory) / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json")).get_vocab(with_added_tokens=True)


def check_vocabulary(draft_dir: str | Path, target: TargetInfo) -> None:
    """Refuse a draft whose vocabulary is not the target's.

    Compares ``config.json``'s ``vocab_size`` (the logits width) and, when both directories
    have a ``tokenizer.json``, the two tokenizers' vocabularies (token string -> id, added
    tokens included).

    Raises:
        ValueError: naming ``speculative_config.model``, on any difference.
    """
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    size = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))
    if size != target.vocab_size:
        raise ValueError(f"speculative_config.model {str(draft_dir)!r} has a vocabulary of {size} tokens, "
                         f"the target's has {target.vocab_size}: the draft must share the target's tokenizer")
    mine, theirs = _tokenizer_vocab(str(draft_dir)), _tokenizer_vocab(target.tokenizer_dir)
    if mine is not None and theirs is not None and mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ValueError(f"speculative_config.model {str(draft_dir)!r} has another tokenizer than the target "
                         f"(e.g. {diff}): the draft must share the target's tokenizer")


class DraftModelProposer:
    """Drafts (greedy or sampled) from a draft model in its own paged KV pool (module docstring).

    Implements ``proposers.Proposer``; ``batched`` tells ``SpecDecoding`` to ask for the whole
    step's requests at once, and ``always_proposes`` that a request with a step in flight
    would always get drafts (so it sits that step out rather than running the draft on
    stale tokens).

    Args:
        config: the validated ``SpeculativeConfig`` (``method`` ``draft_model``).
        target: what the engine says about the target (``TargetInfo``).
        model: an already built draft model (tests); by default loaded from ``config.model``.
    Attributes:
        model: the draft model (``forward(input_ids, positions, kv_caches, meta, logits_indices)``).
        pool: the draft's ``BlockPool``; kv_caches: per layer ``(key, value)``, each
            ``[num_kv_heads, num_blocks, block_size, head_dim]`` of ``target.dtype``.
        step_seconds: measured seconds of one batched draft forward (exponential average; 0.0
            before any), the depth rule's per-drafted-token cost (``depth.py``).
        num_forwards: draft forwards run so far.
        max_len: most positions the draft covers (the target's ``max_model_len``, or less when the
            draft's ``max_position_embeddings`` is smaller: longer requests get no drafts).
    Raises:
        ValueError: the draft's vocabulary is not the target's (``check_vocabulary``), or an
            unservable architecture; ``ModelNotFoundError`` / ``ModelLoadError``: ``config.model``
            cannot be found or read.
    """

    batched = True
    always_proposes = True

    def __init__(self, config: SpeculativeConfig, target: TargetInfo, model: Any = None) -> None:
        from pagedllm.models.resolve import resolve_model
        self.target = target
        self.block_size = target.block_size
        if model is None:
            from pagedllm.models.hf_config import read_hf_config
            from pagedllm.models.load import load_model
            from pagedllm.models.load_plan import plan_load
            draft_dir = resolve_model(config.model)
            check_vocabulary(draft_dir, target)
            plan = plan_load(draft_dir, read_hf_config(draft_dir), target.dtype, target.device, "auto", config.quantization)
            model, cfg = target.run(lambda: load_model(draft_dir, plan))
            self.max_len = min(target.max_model_len, getattr(cfg, "max_position_embeddings", None) or (1 << 30))
        else:
            self.max_len = target.max_model_len
        if getattr(model, "state_cache_spec", None) is not None and model.state_cache_spec():
            raise ValueError(f"speculative_config.model {str(config.model)!r} is a hybrid model (recurrent state): "
                             "pagedllm's draft models are attention-only (the target may be hybrid)")
        self.model = model
        backend = getattr(model, "attention_backend", None)
        if backend is None:
            from pagedllm.attention.torch_paged import TorchPagedBackend
            backend = TorchPagedBackend(target.device)
        self.backend = backend
        num_blocks = config.draft_num_kv_blocks or target.num_blocks
        layers, kvh, d = model.kv_cache_spec()
        shape = (kvh, num_blocks, self.block_size, d)  # head-major, as the runner's
        self.kv_caches = target.run(lambda: [
            (torch.zeros(shape, dtype=target.dtype, device=target.device),
             torch.zeros(shape, dtype=target.dtype, device=target.device)) for _ in range(layers)])
        self.pool = BlockPool(num_blocks)
        per_block = 2 * layers * self.block_size * kvh * d * torch.empty((), dtype=target.dtype).element_size()
        logger.info("draft model %s: its own KV pool of %d blocks x %d tokens (%.1f MiB)", config.model,
                    num_blocks, self.block_size, num_blocks * per_block / 2**20)
        self._seqs: dict[str, _DraftSeq] = {}  # least recently drafted first
        self._batch_ids: set[str] = set()  # the requests of the propose running now
        self.step_seconds = 0.0
        self.num_forwards = 0
        from pagedllm.worker.sampler import Sampler
        self._sampler = Sampler(target.seed)  # its draws' generators and its q (target_probs)
        self._probs: dict[str, list[torch.Tensor]] = {}  # request id -> q rows of its last drafts

    # ---- the Proposer interface --------------------------------------------------------
    def propose(self, batch: list[ProposeItem]) -> dict[str, list[int]]:
        """Up to ``item.k`` draft token ids per request id: the draft's argmax for a greedy
        request, draws from ``q`` for a sampled one (``take_probs`` then gives ``q``). Absent: no
        drafts this step (the draft pool is full, or the request is past the draft's ``max_len``).
        Runs on the core's execution thread (``target.run``); raises nothing of its own."""
        items = [it for it in batch if it.k > 0 and len(it.token_ids) > 0]
        if not items:
            return {}
        return self.target.run(lambda: self._propose(items))

    def finish(self, request_id: str, token_ids=(), num_prompt_tokens: int = 0) -> None:
        """Free the request's draft blocks (tail first, as the target's manager does)."""
        self._probs.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.blocks:
            self.pool.free(list(reversed(seq.blocks)))

    def is_idle(self) -> bool:
        """True when no request holds draft state or blocks: the pool is as it started."""
        return not self._seqs and not self._probs and self.pool.num_free_blocks == self.pool.num_blocks

    # ---- one propose -------------------------------------------------------------------
    @torch.inference_mode()
    def _propose(self, items: list[ProposeItem]) -> dict[str, list[int]]:
        work: list[tuple[ProposeItem, _DraftSeq, list[int]]] = []
        self._batch_ids = {it.request_id for it in items}
        for it in items:
            seq = self._seqs.pop(it.request_id, None) or _DraftSeq()
            self._seqs[it.request_id] = seq  # most recently drafted last (``_evict``'s order)
            tokens = list(it.token_ids)
            if self._fit(seq, tokens, it.k):
                work.append((it, seq, tokens))
        if not work:
            return {}
        for it, _, _ in work:
            self._probs.pop(it.request_id, None)
        logits = self._catch_up([(seq, tokens) for _, seq, tokens in work])
        first = self._pick([it for it, _, _ in work], logits, 0)
        drafts = {it.request_id: [t] for (it, _, _), t in zip(work, first)}
        for j in range(1, max(it.k for it, _, _ in work)):
            active = [(it, seq) for it, seq, _ in work if it.k > j]
            entries = [(seq, len(seq.cached), [drafts[it.request_id][-1]]) for it, seq in active]
            t0 = time.perf_counter()
            logits = self._forward(entries, [True] * len(entries))
            self._timed(time.perf_counter() - t0)
            for (it, seq), t in zip(active, self._pick([it for it, _ in active], logits, j)):
                seq.cached.append(drafts[it.request_id][-1])
                drafts[it.request_id].append(t)
        return drafts

    def _pick(self, items: list[ProposeItem], logits: torch.Tensor, j: int) -> list[int]:
        """Draft ``j`` (0-based) of each item from its row of ``logits`` ``[R, V]`` float32: the
        argmax for greedy requests; for sampled ones a draw from ``q``, the request's
        temperature / top-k / top-p / min-p applied to the draft's logits (``Sampler.target_probs``),
        seeded at its output position (stream 3: verification draws on streams 1 and 2), with
        ``q`` kept for ``take_probs``."""
        out = logits.argmax(-1).tolist()
        rows = [r for r, it in enumerate(items) if it.params is not None and not it.params.greedy]
        if rows:
            q = self._sampler.target_probs(logits[rows], [items[r].params for r in rows])
            for r, qr in zip(rows, q):
                it = items[r]
                pos = len(it.token_ids) - it.num_prompt_tokens + j
                noise = torch.empty_like(qr).exponential_(generator=self._sampler.generator_for(it.params, pos, stream=3))
                out[r] = int((qr / noise).argmax())  # the exponential race: a draw from q
                self._probs.setdefault(it.request_id, []).append(qr)
        return out

    def take_probs(self, request_id: str, n: int) -> torch.Tensor | None:
        """``[n, V]`` float32: the distributions the request's first ``n`` drafts of the last
        propose were drawn from (``None``: greedy drafts, point masses). Forgets them."""
        rows = self._probs.pop(request_id, None)
        return None if not rows or n <= 0 else torch.stack(rows[:n])

    def _fit(self, seq: _DraftSeq, tokens: list[int], k: int) -> bool:
        """Roll ``seq`` back to the longest prefix of ``tokens`` its cache holds (at most
        ``len(tokens) - 1``: the last token's row gives the first draft) and size its block table
        for ``len(tokens) + k - 1`` tokens. False (nothing allocated) when the pool lacks blocks."""
        # tokens[:seq.committed] were committed at the last propose and cannot have changed
        start = min(seq.committed, len(seq.cached), len(tokens))
        keep = start
        if len(tokens) + k - 1 > self.max_len:
            return False
        for a, b in zip(seq.cached[start:], tokens[start:]):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)
        del seq.cached[keep:]
        seq.committed = len(tokens)
        need = _cdiv(len(tokens) + k - 1, self.block_size)
        if len(seq.blocks) > need:
            self.pool.free(list(reversed(seq.blocks[need:])))
            del seq.blocks[need:]
        grow = need - len(seq.blocks)
        if grow > self.pool.num_free_blocks:
            self._evict(grow - self.pool.num_free_blocks)
        if grow > self.pool.num_free_blocks:
            held = _cdiv(keep, self.block_size)  # keep what holds the kept prefix, return the rest
            if len(seq.blocks) > held:
                self.pool.free(list(reversed(seq.blocks[held:])))
                del seq.blocks[held:]
            return False
        if grow > 0:
            seq.blocks.extend(self.pool.allocate(grow))
        return True

    def _evict(self, num_blocks: int) -> None:
        """Free the caches of requests outside this propose (preempted, waiting, or at depth 0),
        least recently drafted first, until ``num_blocks`` more are free or none is left; they
        are recomputed when they next get drafts."""
        for rid in list(self._seqs):
            seq = self._seqs[rid]
            if rid in self._batch_ids or not seq.blocks:
                continue
            freed = len(seq.blocks)
            self.pool.free(list(reversed(seq.blocks)))
            seq.blocks, seq.cached, seq.committed = [], [], 0
            num_blocks -= freed
            if num_blocks <= 0:
                return

    def _catch_up(self, seqs: list[tuple[_DraftSeq, list[int]]]) -> torch.Tensor:
        """Run each request's committed tokens its cache lacks; returns ``[R, V]`` float32 logits,
        each request's row after its last committed token (its first draft's).

        Forwards hold at most ``max_num_batched_tokens`` tokens (a long prompt spans several)."""
        budget = max(1, self.target.max_num_batched_tokens)
        first: list[torch.Tensor | None] = [None] * len(seqs)
        todo = list(range(len(seqs)))
        while todo:
            entries, rows, left = [], [], budget
            for i in todo:
                seq, tokens = seqs[i]
                if left == 0:
                    break
                pos = len(seq.cached)
                chunk = tokens[pos:pos + left]
                entries.append((seq, pos, chunk))
                rows.append(i)
                left -= len(chunk)
            done = [pos + len(chunk) == len(seqs[i][1]) for i, (_, pos, chunk) in zip(rows, entries)]
            t0 = time.perf_counter()
            logits = self._forward(entries, done)
            if qsl_tokens := sum(len(c) for _, _, c in entries):
                if qsl_tokens <= 17 * len(entries):  # a steady-state catch-up (k + 1 tokens), not a prompt
                    self._timed(time.perf_counter() - t0)
            picks = iter(logits)
            for i, (seq, _, chunk), fin in zip(rows, entries, done):
                seq.cached.extend(chunk)
                if fin:
                    first[i] = next(picks)
            todo = [i for i in todo if first[i] is None]
        return torch.stack(first)  # type: ignore[arg-type]

    def _forward(self, entries: list[tuple[_DraftSeq, int, list[int]]], want: list[bool]) -> torch.Tensor:
        """One draft forward over ``entries`` (``(seq, first position, tokens)``), writing their
        K/V into the draft pool; returns ``[sum(want), V]`` float32 logits of the last row of each
        entry whose ``want`` is set."""
        bs, dev = self.block_size, self.target.device
        n = np.fromiter((len(t) for _, _, t in entries), dtype=np.int64, count=len(entries))
        start = np.fromiter((p for _, p, _ in entries), dtype=np.int64, count=len(entries))
        qsl = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        width = max(len(s.blocks) for s, _, _ in entries)
        table = np.zeros((len(entries), width), dtype=np.int64)  # past a table's end: block 0 (any valid id)
        for r, (seq, _, _) in enumerate(entries):
            table[r, :len(seq.blocks)] = [b.block_id for b in seq.blocks]
        row = np.repeat(np.arange(len(entries)), n)
        pos = np.arange(qsl[-1], dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
        slots = table[row, pos // bs] * bs + pos % bs
        ids = np.fromiter((t for _, _, toks in entries for t in toks), dtype=np.int64, count=int(qsl[-1]))
        meta = self.backend.build_metadata(AttentionBatch(
            query_start_loc=qsl, num_computed=start, seq_lens=start + n, slot_mapping=slots,
            block_table=table, rows=np.arange(len(entries), dtype=np.int64), block_size=bs))
        last = torch.from_numpy(qsl[1:][np.asarray(want, dtype=bool)] - 1).to(dev)
        self.num_forwards += 1
        return self.model(torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), self.kv_caches, meta, last)

    def _timed(self, seconds: float) -> None:
        self.step_seconds = seconds if self.step_seconds == 0.0 else (
            STEP_DECAY * self.step_seconds + (1 - STEP_DECAY) * seconds)
