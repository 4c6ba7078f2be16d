"""The scheduler's side of speculative decoding: which requests get drafts, how many, and the
counters (``SpecDecoding``).

Drafts need a request's committed tokens, so a request is given drafts only when no step of
its is in flight. Under async scheduling a request usually has one in flight when the next
step is planned; it then goes on without drafts (on its placeholder, as without speculation)
unless the proposer already finds a match on the tokens known so far: then it sits that step
out, and the next step, planned once its token has arrived, carries the drafts. A request with
drafts in flight is never planned again until their verdict arrives (its accepted count moves
``num_computed_tokens``). Requests with structured outputs get no drafts (their grammar would
have to judge draft tokens before the target does).
"""

from __future__ import annotations

from pagedllm.request import Request
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.depth import DepthController
from pagedllm.spec_decode.proposers import NgramProposer, ProposeItem, Proposer, SuffixProposer

HOLD = None  # drafts_for's answer: skip the request this step (its drafts come with the next)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer ``config.method`` names."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_min_token_prob)


class SpecDecoding:
    """Draft planning and the speculation counters of one scheduler.

    Args:
        config: the validated ``SpeculativeConfig``.
        max_model_len: longest sequence (drafts never reach past it).
    Attributes:
        num_drafts: verified steps that carried drafts; num_draft_tokens, num_accepted_tokens: their
            draft tokens and how many were kept; accepted_per_position: kept drafts by position (0-based).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config)
        self.depth = DepthController(config.num_speculative_tokens, config.dynamic)
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
        if num_new != 1 or req.structured is not None or req.spec_token_ids:
            return []
        pending = req.num_output_placeholders
        if req.num_computed_tokens != req.num_tokens + pending - 1:
            return []  # still in prefill
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - pending - 1,
                   self.max_model_len - req.num_tokens - pending - 1)
        k = min(self.depth.depth(req.request_id, batch_size), room)
        if k <= 0:
            return []
        item = ProposeItem(req.request_id, req.all_token_ids, req.num_prompt_tokens, k)
        drafts = self.proposer.propose([item]).get(req.request_id, [])
        if pending:
            return HOLD if drafts else []  # drafts from the known tokens would be one token stale
        self.depth.planned(req.request_id, len(drafts[:k]))
        return drafts[:k]

    def begin_step(self) -> None:
        """The scheduler starts planning a step."""
        self.depth.begin_step()

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
