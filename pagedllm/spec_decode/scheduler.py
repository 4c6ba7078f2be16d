"""The scheduler's side of speculative decoding: which requests get drafts, how many, and the
counters (``SpecDecoding``).

Drafts need a request's committed tokens, so a request is given drafts only when no step of
its is in flight. Under async scheduling a request usually has one in flight when the next
step is planned; it then goes on without drafts (on its placeholder, as without speculation)
unless the proposer already finds a match on the tokens known so far: then it sits that step
out, and the next step, planned once its token has arrived, carries the drafts. A request with
drafts in flight is never planned again until their verdict arrives (its accepted count moves
``num_computed_tokens``).

Structured outputs: a constrained request gets drafts once its grammar judges its tokens (compiled,
past any reasoning); point-mass drafts (n-gram, suffix) are cut at the first token the grammar
refuses, which is exact (that draft would be rejected with probability 1). Drafts sampled from a
distribution (``draft_model``) are kept whole: cutting them would change the proposal the
rejection rule corrects for, and a refused draft is rejected by the masked target anyway. The
core fills one mask row per logits row, consuming the drafts and rolling the matcher back
(``GrammarState.fill``).

A ``batched`` proposer (``draft_model``: one model forward serves many requests) is asked once
per step, in ``begin_step``, for every running request that may get drafts, each at the depth
the depth rule estimates for it; ``drafts_for`` then takes each request's share. An
``always_proposes`` proposer would always find drafts, so a request with a step in flight sits
that step out whenever its depth is above 0, without running the proposer on stale tokens.
"""

from __future__ import annotations

from typing import Iterable

from pagedllm.request import Request
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.depth import DepthController
from pagedllm.spec_decode.proposers import NgramProposer, ProposeItem, Proposer, SuffixProposer

HOLD = None  # drafts_for's answer: skip the request this step (its drafts come with the next)


def make_proposer(config: SpeculativeConfig, draft: Proposer | None = None) -> Proposer:
    """The proposer ``config.method`` names.

    Args:
        config: the validated configuration.
        draft: for ``draft_model``, the draft model's proposer, which the engine core builds
            (``worker/draft_model.py``: a model runner of its own, above this floor).
    Raises:
        ValueError: ``draft_model`` without ``draft``.
    """
    if config.method == "draft_model":
        if draft is None:
            raise ValueError("speculative_config.method 'draft_model' needs the draft model's proposer "
                             "(worker.draft_model.DraftModelProposer)")
        return draft
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_min_token_prob)


class SpecDecoding:
    """Draft planning and the speculation counters of one scheduler.

    Args:
        config: the validated ``SpeculativeConfig``.
        max_model_len: longest sequence (drafts never reach past it).
        draft: the draft model's proposer for ``draft_model`` (``make_proposer``).
        async_scheduling: the engine plans each step while the previous one runs (the depth rule
            counts the step a request with drafts in flight misses).
    Attributes:
        num_drafts: verified steps that carried drafts; num_draft_tokens, num_accepted_tokens: their
            draft tokens and how many were kept; accepted_per_position: kept drafts by position (0-based).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: Proposer | None = None,
                 async_scheduling: bool = False) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config, draft)
        self.depth = DepthController(config.num_speculative_tokens, config.dynamic, async_scheduling)
        self._prefetched: dict[str, list[int]] | None = None  # a batched proposer's drafts of this step
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def drafts_for(self, req: Request, num_new: int, budget: int, batch_size: int) -> list[int] | None:
        """Draft tokens to schedule after ``req``'s one decode token, ``[]`` for none, or ``HOLD``.

        Args:
            req: a running request about to be scheduled ``num_new`` tokens.
            num_new: its tokens without drafts (drafts only follow a single decode token).
            budget: the step's token budget left, ``num_new`` included.
            batch_size: decodes expected in the step (the depth rule's ``B``).
        """
        if num_new != 1 or not self._decoding(req):
            return []
        pending = req.num_output_placeholders
        room = min(budget - 1, self._room(req))
        k = min(self.depth.depth(req.request_id, batch_size, sit_out=bool(pending)), room)
        if k <= 0:
            return []
        if pending and getattr(self.proposer, "always_proposes", False):
            return HOLD
        if self._prefetched is not None and not pending:
            drafts = self._prefetched.get(req.request_id, [])
        else:
            item = ProposeItem(req.request_id, req.all_token_ids, req.num_prompt_tokens, k, req.sampling_params)
            drafts = self.proposer.propose([item]).get(req.request_id, [])
        if pending:
            return HOLD if drafts else []  # drafts from the known tokens would be one token stale
        if req.structured is not None and getattr(self.proposer, "take_probs", None) is None:
            drafts = req.structured.valid_drafts(drafts[:k])
        self.depth.planned(req.request_id, len(drafts[:k]))
        return drafts[:k]

    @staticmethod
    def _decoding(req: Request) -> bool:
        """A request that may get drafts: decoding (prefill done), no drafts in flight, and either
        unconstrained or with a grammar that judges its next tokens."""
        return ((req.structured is None or req.structured.constraining) and not req.spec_token_ids
                and req.num_computed_tokens == req.num_tokens + req.num_output_placeholders - 1)

    def _room(self, req: Request) -> int:
        """Most drafts the request's ``max_tokens`` and the context limit leave (before the budget)."""
        pending = req.num_output_placeholders
        return min(req.max_tokens - req.num_output_tokens - pending - 1, self.max_model_len - req.num_tokens - pending - 1)

    def draft_probs(self, request_id: str, num_drafts: int):
        """``[num_drafts, V]`` float32 distributions the request's scheduled drafts were drawn from
        (a proposer that samples drafts: ``take_probs``), or ``None`` (point masses)."""
        take = getattr(self.proposer, "take_probs", None)
        return take(request_id, num_drafts) if take is not None else None

    def begin_step(self, running: Iterable[Request] = ()) -> None:
        """The scheduler starts planning a step over its ``running`` requests: a ``batched``
        proposer drafts now for every one that may get drafts (``drafts_for`` takes its share)."""
        self.depth.begin_step()
        self.depth.proposer_step_s = getattr(self.proposer, "step_seconds", 0.0)
        self._prefetched = None
        if not getattr(self.proposer, "batched", False):
            return
        running = list(running)
        items = []
        for req in running:
            if req.num_output_placeholders or not self._decoding(req):
                continue
            k = min(self.depth.estimate(req.request_id, len(running)), self._room(req))
            if k > 0:
                items.append(ProposeItem(req.request_id, req.all_token_ids, req.num_prompt_tokens, k,
                                         req.sampling_params))
        self._prefetched = self.proposer.propose(items) if items else {}

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Count one verified step of ``req``: ``num_accepted`` of its ``num_drafts`` drafts kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        req.spec_num_draft_tokens += num_drafts
        req.spec_num_accepted_tokens += num_accepted
        self.depth.record(req.request_id, num_drafts, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step's token count and execute time (the depth rule's cost model)."""
        self.depth.observe(num_tokens, seconds)

    def finish(self, req: Request) -> None:
        """The request left the scheduler (finished or aborted)."""
        self.proposer.finish(req.request_id, req.all_token_ids, req.num_prompt_tokens)
        self.depth.finish(req.request_id)
