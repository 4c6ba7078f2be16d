"""A test hook: the model runner replays fixed output tokens instead of the sampled ones.

A test builds one ``ScriptedOutput``, passes it to the engine
(``LLMEngine(args, scripted_output=...)``, in process only) and ``set``s the
tokens before each request. The model still runs and samples; only the tokens
handed back are replaced, so the front end (detokenizer, stop strings, parsers)
sees exactly the scripted text; logprobs are those of the sampled tokens, not
the replayed ones.
"""

from __future__ import annotations

from collections.abc import Iterable


class ScriptedOutput:
    """Every request's output is ``token_ids``, then EOS, whatever the model says.

    Safe to ``set`` from another thread while the engine runs: a step reads the
    current script once (one reference read), so it never sees half of an update.

    Args:
        token_ids: the initial script (default: empty, so every request ends at once with EOS).
    """

    def __init__(self, token_ids: Iterable[int] = ()) -> None:
        self._ids: tuple[int, ...] = tuple(token_ids)

    def set(self, token_ids: Iterable[int]) -> None:
        """Replace the script; steps issued after this call replay the new one."""
        self._ids = tuple(int(t) for t in token_ids)

    def tokens(self, output_lens: list[int], eos: int) -> list[int]:
        """The scripted token of each sampled row.

        Args:
            output_lens: per row, the tokens its request generated before this one.
            eos: the token past the script's end.
        Returns:
            One token id per row: ``token_ids[output_len]``, or ``eos`` past the script's end.
        """
        ids = self._ids
        return [ids[pos] if pos < len(ids) else eos for pos in output_lens]
