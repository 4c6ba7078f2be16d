"""Logprobs in the OpenAI response formats.

Chat (OpenAI Chat Completions reference): ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}``
with exactly ``top_logprobs`` alternatives, most likely first.

Completions (OpenAI legacy Completions reference): ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``; each ``top_logprobs`` entry maps token text to
logprob for the top ``logprobs`` tokens plus the sampled one (so up to
``logprobs + 1`` entries), and ``text_offset`` is each token's character offset
in the choice's text. With ``echo`` the prompt's tokens come first, the first
of them with a null logprob.
"""

from __future__ import annotations

from pagedllm.outputs import Logprob, PositionLogprobs

_FLOOR = -9999.0  # JSON has no -Infinity; vLLM uses the same floor


def _lp(x: float) -> float:
    return max(x, _FLOOR)


def _own(pos: PositionLogprobs) -> Logprob:
    """The position's own (sampled or prompt) token: always the dict's first entry."""
    return next(iter(pos.values()))


def _top(pos: PositionLogprobs, k: int) -> list[Logprob]:
    return sorted((lp for lp in pos.values() if lp.rank <= k), key=lambda lp: lp.rank)[:k]


def chat_logprobs(positions: list[PositionLogprobs], top_logprobs: int) -> dict:
    """The chat ``choices[i].logprobs`` object.

    Args:
        positions: one entry per generated token (own token first).
        top_logprobs: alternatives to list per token (0-20).
    """
    def item(lp: Logprob) -> dict:
        return {"token": lp.decoded_token, "logprob": _lp(lp.logprob), "bytes": list(lp.decoded_token.encode())}

    content = []
    for pos in positions:
        own = item(_own(pos))
        own["top_logprobs"] = [item(lp) for lp in _top(pos, top_logprobs)]
        content.append(own)
    return {"content": content, "refusal": None}


def completion_logprobs(positions: list[PositionLogprobs], k: int,
                        prompt_positions: list[PositionLogprobs | None] | None = None,
                        initial_offset: int = 0, first_prompt_text: str = "") -> dict:
    """The completions ``choices[i].logprobs`` object.

    Args:
        positions: one entry per generated token.
        k: the request's ``logprobs`` (alternatives per token, 0-20).
        prompt_positions: with ``echo``, the prompt's entries (first one ``None``).
        initial_offset: characters of the choice's text before these tokens (streaming).
        first_prompt_text: with ``echo``, the text of the prompt's first token.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = initial_offset
    for pos in list(prompt_positions or []) + list(positions):
        if pos is None:  # the first prompt token: no context, no logprob
            tokens.append(first_prompt_text)
            token_lps.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(first_prompt_text)
            continue
        own = _own(pos)
        tokens.append(own.decoded_token)
        token_lps.append(_lp(own.logprob))
        top = {lp.decoded_token: _lp(lp.logprob) for lp in _top(pos, k)}
        top.setdefault(own.decoded_token, _lp(own.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(own.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def tokens_length(logprobs: dict) -> int:
    """Characters covered by a completions ``logprobs`` object's tokens (the next chunk's offset base)."""
    return sum(len(t) for t in logprobs["tokens"])


def prompt_logprobs_out(positions: list[PositionLogprobs | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` response field: per prompt token, ``None`` for the first, then
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the token itself and the top-k)."""
    if positions is None:
        return None
    return [None if pos is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for t, lp in pos.items()}
            for pos in positions]
