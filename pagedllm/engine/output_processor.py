"""Turns engine-core outputs (token ids) into user-facing ``RequestOutput``s.

Runs in the front end: detokenization and stop strings never touch the step loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    """Front-end state of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int]
    arrival: float
    first_token_time: float | None = None


class OutputProcessor:
    """Keeps every live request's detokenizer and builds its outputs.

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival: float) -> None:
        """Start tracking a request."""
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                               IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids),
                                               [], arrival)

    def abort(self, request_id: str) -> None:
        """Forget a request (no more outputs for it)."""
        self.states.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput], delta: bool) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's core outputs.

        Args:
            outputs: the step's per-request results.
            delta: True to return only new text/tokens (streaming), False for cumulative outputs.
        Returns:
            ``(request_outputs, stopped_ids)`` where ``stopped_ids`` are requests ended
            by a stop string that the core must now abort.
        """
        results, stopped = [], []
        now = time.time()
        for eo in outputs:
            st = self.states.get(eo.request_id)
            if st is None:
                continue
            if st.first_token_time is None and eo.new_token_ids:
                st.first_token_time = now
            finish_reason, stop_reason = eo.finish_reason, eo.stop_reason
            n_before = len(st.token_ids)
            st.token_ids.extend(eo.new_token_ids)
            if st.detok.append(eo.new_token_ids, finished=finish_reason is not None):
                finish_reason, stop_reason = "stop", st.detok.stop_reason
                if eo.finish_reason is None:
                    stopped.append(eo.request_id)
            finished = finish_reason is not None
            text_delta = st.detok.get_delta(finished)
            if delta:
                text, toks = text_delta, st.token_ids[n_before:]
            else:
                text, toks = st.detok.output_text[:st.detok.sent_offset], list(st.token_ids)
            comp = CompletionOutput(0, text, toks, finish_reason, stop_reason)
            metrics = {"arrival": st.arrival, "first_token": st.first_token_time or now,
                       "num_prompt_tokens": len(st.prompt_token_ids), "num_generation_tokens": len(st.token_ids)}
            if finished:
                metrics["finished"] = now
                del self.states[eo.request_id]
            results.append(RequestOutput(eo.request_id, st.prompt, st.prompt_token_ids, [comp], finished, metrics))
        return results, stopped
