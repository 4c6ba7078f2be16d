"""The offline API: ``LLM.generate`` and ``LLM.chat``, named and shaped as vLLM's."""

from __future__ import annotations

import itertools
from typing import Sequence

import msgspec
from tqdm import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import prepare_messages
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLM:
    """Generate text offline with continuous batching.

    Args:
        model: Hugging Face directory or ``.gguf`` file; ``None`` for the embedded SmolLM2.
        **engine_args: any ``EngineArgs`` field (``block_size``, ``num_kv_blocks``, ...).
    Raises:
        TypeError: an unknown keyword argument.

    Example::

        llm = LLM()
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's attribute name for it)."""
        return self.engine

    def get_tokenizer(self):
        """The model's ``transformers`` tokenizer."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` sampling defaults
        (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM's ``--generation-config auto``."""
        return SamplingParams(**self.engine.default_sampling_fields())

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for text prompts or token-id prompts.

        Args:
            prompts: one prompt or a list; a prompt is a string or a list of token ids.
            sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar.
        Returns:
            One finished ``RequestOutput`` per prompt, in input order.
        Raises:
            ValueError: a prompt is too long or the parameter list has the wrong length.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_item(sampling_params, len(prompts))
        return self._run([(p, sp, None) for p, sp in zip(prompts, params)], use_tqdm)

    def _params_per_item(self, sampling_params, n: int) -> list[SamplingParams]:
        """One ``SamplingParams`` per prompt: the given one for all, or the given list (vLLM's rule).

        Raises:
            ValueError: a list of the wrong length.
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate assistant replies for one conversation or a list of them.

        Each conversation is rendered with the tokenizer's chat template
        (``apply_chat_template``, given ``tools`` in OpenAI's shape when set) and
        tokenized without adding special tokens again. Parse tool calls and
        reasoning out of the text with ``pagedllm.parsers.parse_whole``.

        ``sampling_params``: one for all conversations or one per conversation.

        Returns:
            One ``RequestOutput`` per conversation, in input order.
        Raises:
            ValueError: a ``sampling_params`` list of the wrong length.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = []
        for conv, sp in zip(convs, self._params_per_item(sampling_params, len(convs))):
            text = self.engine.tokenizer.apply_chat_template(prepare_messages(conv), tools=tools, tokenize=False,
                                                             add_generation_prompt=add_generation_prompt,
                                                             **(chat_template_kwargs or {}))
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            items.append((ids, sp, text))
        return self._run(items, use_tqdm)

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        """Add every item (``n`` samples each, as child requests), step to completion, merge the children."""
        eng = self.engine
        groups: list[tuple[str, list[str]]] = []  # (request id, child request ids)
        try:
            for prompt, sp, text in items:
                rid = str(next(self._ids))
                children = [(f"{rid}_{i}", sp.child(i)) for i in range(sp.n)] if sp.n > 1 else [(rid, sp)]
                groups.append((rid, [c for c, _ in children]))
                for cid, csp in children:
                    eng.add_request(cid, prompt, csp, prompt_text=text)
            done: dict[str, RequestOutput] = {}
            bar = tqdm(total=sum(len(g) for _, g in groups), desc="Processed prompts", disable=not use_tqdm)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
            bar.close()
        except BaseException:
            eng.abort_request([c for _, g in groups for c in g])  # KeyboardInterrupt or a bad prompt: free every block
            raise
        return [merge_samples(rid, [done[c] for c in g]) for rid, g in groups]


def merge_samples(request_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One ``RequestOutput`` from the outputs of an ``n``-sample request's children.

    Sample ``i``'s output gets ``index == i``; prompt fields come from the first child.
    """
    first = children[0]
    if len(children) == 1:
        first.request_id = request_id
        return first
    outputs = []
    for i, child in enumerate(children):
        comp = child.outputs[0]
        comp.index = i
        outputs.append(comp)
    metrics = msgspec.structs.replace(first.metrics, num_generation_tokens=sum(
        c.metrics.num_generation_tokens for c in children))
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, outputs,
                         all(c.finished for c in children), metrics, first.prompt_logprobs)
