"""Incremental detokenization with stop strings.

Text is produced with a sliding window (as Hugging Face's ``TextStreamer``
does): decode ``tokens[prefix:]`` and subtract the decode of
``tokens[prefix:read]``. Tokens that end in an incomplete UTF-8 character
decode to U+FFFD and are held until the character completes, so the text never
contains a replacement character that the full decode would not.
"""

from __future__ import annotations

from pagedllm.sampling_params import SamplingParams

_WINDOW = 6  # tokens of left context; enough for tokenizers whose pieces depend on neighbours


def special_token_ids(tokenizer) -> set[int]:
    """Every id ``tokenizer.decode(..., skip_special_tokens=True)`` drops.

    ``all_special_ids`` lists only the named roles (bos, eos, unk, pad, ...);
    added tokens marked ``special`` (SmolLM2's ``<file_sep>``, Llama 3's
    reserved tokens) are skipped by ``decode`` too.
    """
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, checking stop strings.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        params: the request's sampling parameters (stop, skip_special_tokens, ...).
        prompt_token_ids: the prompt, used as left context for the first tokens.
    """

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop = params.stop or []
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.tokens = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self.sent_offset = 0
        self.stop_reason: str | None = None
        self._stop_checked = 0  # text before this index holds no stop string
        self._special = special_token_ids(tokenizer) if params.skip_special_tokens else set()
        self.token_texts: list[str] = []  # per appended token, the text it added (they join to output_text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self._special], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False,
                                     spaces_between_special_tokens=self.params.spaces_between_special_tokens)

    def append(self, new_token_ids: list[int], finished: bool, eos_last: bool = False) -> bool:
        """Add tokens; returns True when a stop string ended the output (never before ``min_tokens``).

        Stop token ids are not detokenized (the scheduler reports them in
        ``stop_reason`` instead), nor is an EOS token that ended the output
        (``eos_last``), even with ``skip_special_tokens=False``, as in vLLM.
        """
        for i, tok in enumerate(new_token_ids):
            before = len(self.output_text)
            if tok in self.params.stop_token_ids or (eos_last and i == len(new_token_ids) - 1):
                self.token_texts.append("")
                continue
            self.tokens.append(tok)
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.output_text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            elif finished and i == len(new_token_ids) - 1 and len(full) > len(prefix):
                # the output's last token (by position: a verified draft step can hold the same id
                # earlier, whose partial character must still be held) flushes what is left
                self.output_text += full[len(prefix):]
            self.token_texts.append(self.output_text[before:])
            if len(self.token_texts) <= self.params.min_tokens:
                # vLLM's rule: no stop string ends the output before min_tokens tokens exist;
                # the search later looks back only a stop string's length into this text
                self._stop_checked = len(self.output_text)
                continue
            if self.stop and self._check_stop():
                self._trim_token_texts()
                return True
        return False

    def _trim_token_texts(self) -> None:
        """Cut the per-token texts after a stop string truncated the output, so they still join to it."""
        room = len(self.output_text)
        for i, t in enumerate(self.token_texts):
            self.token_texts[i] = t[:max(room, 0)]
            room -= len(t)

    @property
    def num_tokens(self) -> int:
        """Generated tokens appended so far (stop token ids included)."""
        return len(self.token_texts)

    def _check_stop(self) -> bool:
        text = self.output_text
        start = max(0, self._stop_checked - self.max_stop_len + 1)
        self._stop_checked = len(text)
        best = None
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.output_text = text[:i + len(s)] if self.params.include_stop_str_in_output else text[:i]
        self.stop_reason = s
        return True

    def get_delta(self, finished: bool) -> str:
        """Text not yet handed out. While running, a tail that could start a stop string is held back."""
        end = len(self.output_text)
        if not finished and self.stop:
            end -= self._held_back()
        end = max(end, self.sent_offset)
        delta = self.output_text[self.sent_offset:end]
        self.sent_offset = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.output_text
        for k in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


class NullDetokenizer:
    """The detokenizer of a request that wants no text (``detokenize=False``, or an engine built
    with ``skip_tokenizer_init``): token ids only, every text empty; ``IncrementalDetokenizer``'s
    interface.

    Args:
        params: the request's sampling parameters (unused: no stop string can apply).
    """

    output_text = ""
    sent_offset = 0
    stop_reason = None

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.token_texts: list[str] = []

    def append(self, new_token_ids: list[int], finished: bool, eos_last: bool = False) -> bool:
        """Count the tokens; never a stop string."""
        self.token_texts += [""] * len(new_token_ids)
        return False

    @property
    def num_tokens(self) -> int:
        """Generated tokens appended so far."""
        return len(self.token_texts)

    def get_delta(self, finished: bool) -> str:
        """Always ``""``."""
        return ""


def token_texts(tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    """The text each token adds when ``token_ids`` are decoded left to right; they join to the decoded text.

    A token that ends inside a multi-byte character gets ``""`` and the token
    completing the character gets all of it.
    """
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(max_tokens=None, skip_special_tokens=skip_special_tokens),
                                   [])
    detok.append(list(token_ids), finished=True)
    return detok.token_texts
