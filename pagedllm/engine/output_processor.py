"""Turns engine-core outputs (token ids) into user-facing ``RequestOutput``s.

Runs in the front end: detokenization and stop strings never touch the step loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.core.scheduler_output import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer, NullDetokenizer, token_texts
from pagedllm.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, PositionLogprobs,
                              RequestOutput)
from pagedllm.sampling_params import SamplingParams
from pagedllm.stats import RequestMetrics


@dataclass
class RequestState:
    """Front-end state of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | NullDetokenizer
    token_ids: list[int]
    arrival: float
    first_token_time: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_texts: list[str] | None = None
    cumulative_logprob: float = 0.0
    lp_sent: int = 0    # delta mode: logprob entries handed out so far
    lp_chars: int = 0   # characters of text those entries' tokens cover
    spec_counts: tuple[int, int] = (0, 0)  # draft tokens verified, accepted (speculative decoding)


class OutputProcessor:
    """Keeps every live request's detokenizer and builds its outputs.

    Args:
        tokenizer: the model's tokenizer (``None``: no text at all, ``skip_tokenizer_init``).
        eos_token_ids: the engine's EOS ids: a "stop" without a stop reason drops its last token
            from the text only when it is one of them.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # None: every plain "stop" ended on EOS (no grammar end)
        self.states: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}  # decode([id]) of top-k alternatives, cached

    def _text_of(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position(self, entry: TokenLogprobs, own_text: str) -> PositionLogprobs:
        """One position's dict: its own token (with ``own_text``) first, then the alternatives by rank."""
        pos = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.rank, own_text)}
        for r, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            if tid not in pos:
                pos[tid] = Logprob(lp, r, self._text_of(tid))
        return pos

    @staticmethod
    def _release_logprobs(st: RequestState, finished: bool) -> list[PositionLogprobs]:
        """Delta mode: the logprob entries whose tokens' text has been handed out.

        Text that may start a stop string is held back; its tokens' logprobs wait
        with it, so each streamed chunk carries the logprobs of its own text and
        the token strings stay in step with the text (a stop string may still
        shorten them).
        """
        texts = st.detok.token_texts
        released = st.detok.sent_offset
        j = st.lp_sent
        while j < len(st.logprobs) and (finished or st.lp_chars + len(texts[j]) <= released):
            st.lp_chars += len(texts[j])
            j += 1
        out, st.lp_sent = st.logprobs[st.lp_sent:j], j
        return out

    def _add_prompt_logprobs(self, st: RequestState, first: int, entries: list[TokenLogprobs]) -> None:
        """Record prompt logprobs from ``first`` on; positions seen before (a preempted
        request recomputes its prompt) are ignored."""
        if st.prompt_texts is None:
            st.prompt_texts = (token_texts(self.tokenizer, st.prompt_token_ids) if self.tokenizer is not None
                               and st.params.detokenize else [""] * len(st.prompt_token_ids))
        have = len(st.prompt_logprobs)
        for i, e in enumerate(entries):
            if first + i == have:
                st.prompt_logprobs.append(self._position(e, st.prompt_texts[have]))
                have += 1

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival: float) -> None:
        """Start tracking a request."""
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                               self._detokenizer(params, prompt_token_ids),
                                               [], arrival, logprobs=[] if params.logprobs is not None else None,
                                               # the first prompt token has no logprob (and a one-token
                                               # prompt has no other)
                                               prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def _detokenizer(self, params: SamplingParams, prompt_token_ids: list[int]):
        if self.tokenizer is None or not params.detokenize:
            return NullDetokenizer(params)
        return IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Forget a request (no more outputs for it)."""
        self.states.pop(request_id, None)

    def _pooled(self, st: RequestState, vector: list[float], now: float) -> PoolingRequestOutput:
        """The finished output of a pooling request (its state is dropped)."""
        del self.states[st.request_id]
        metrics = RequestMetrics(st.arrival, now, now, len(st.prompt_token_ids), 0)
        return PoolingRequestOutput(st.request_id, PoolingOutput(vector), st.prompt_token_ids, True, metrics,
                                    st.prompt)

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
            if eo.pooled is not None:
                results.append(self._pooled(st, eo.pooled, now))
                continue
            if eo.prompt_logprobs is not None:
                self._add_prompt_logprobs(st, *eo.prompt_logprobs)
            if not eo.new_token_ids and eo.finish_reason is None:
                continue  # a prefill chunk: nothing to show yet
            if st.first_token_time is None and eo.new_token_ids:
                st.first_token_time = now
            finish_reason, stop_reason = eo.finish_reason, eo.stop_reason
            n_before = len(st.token_ids)
            st.token_ids.extend(eo.new_token_ids)
            # finished "stop" with no stop_reason on an EOS token, which is not text (a grammar
            # that reached its end also stops without a reason, on a token that is text)
            eos_last = (eo.finish_reason == "stop" and eo.stop_reason is None and bool(eo.new_token_ids)
                        and (self.eos_token_ids is None or eo.new_token_ids[-1] in self.eos_token_ids))
            new_lps = eo.new_logprobs or []
            if st.detok.append(eo.new_token_ids, finished=finish_reason is not None, eos_last=eos_last):
                finish_reason, stop_reason = "stop", st.detok.stop_reason
                if eo.finish_reason is None:
                    stopped.append(eo.request_id)
                # several tokens in one step (speculative decoding): those after the stop string's go
                del st.token_ids[st.detok.num_tokens:]
                new_lps = new_lps[:len(st.token_ids) - n_before]
            if st.logprobs is not None:
                texts = st.detok.token_texts
                for j, e in enumerate(new_lps):
                    st.logprobs.append(self._position(e, texts[n_before + j]))
                    st.cumulative_logprob += e.logprobs[0]
                if finish_reason == "stop" and stop_reason is not None and isinstance(stop_reason, str):
                    # a stop string cut the text: keep each token's text consistent with it
                    for pos, text in zip(st.logprobs, texts):
                        next(iter(pos.values())).decoded_token = text
            finished = finish_reason is not None
            text_delta = st.detok.get_delta(finished)
            lps = st.logprobs
            if delta:
                text, toks = text_delta, st.token_ids[n_before:]
                lps = None if lps is None else self._release_logprobs(st, finished)
            else:
                text, toks = st.detok.output_text[:st.detok.sent_offset], list(st.token_ids)
                lps = None if lps is None else list(lps)
            comp = CompletionOutput(0, text, toks, finish_reason, stop_reason, lps,
                                    st.cumulative_logprob if st.logprobs is not None else None)
            if eo.spec_counts is not None:
                st.spec_counts = eo.spec_counts
            metrics = RequestMetrics(st.arrival, st.first_token_time or now, now if finished else None,
                                     len(st.prompt_token_ids), len(st.token_ids), *st.spec_counts)
            if finished:
                del self.states[eo.request_id]
            # prompt logprobs go out once, with the first output that carries tokens
            plp = None
            if st.prompt_logprobs is not None and (not delta or n_before == 0):
                plp = list(st.prompt_logprobs)
            results.append(RequestOutput(eo.request_id, st.prompt, st.prompt_token_ids, [comp], finished, metrics,
                                         plp))
        return results, stopped
