"""The offline API: ``LLM.generate`` and ``LLM.chat``, named and shaped as vLLM's."""

from __future__ import annotations

import itertools
from typing import Sequence

import msgspec
from tqdm import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import prepare_messages, take_media
from pagedllm.inputs import PromptType, parse_prompt
from pagedllm.multimodal_inputs import MultiModalPrompt
from pagedllm.outputs import (ClassificationOutput, ClassificationRequestOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from pagedllm.pooling_params import PoolingParams, cosine, pair_texts
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

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate completions for prompts of any of vLLM's shapes.

        Args:
            prompts: one prompt or a list; a prompt is a string, a list of token ids, a
                ``TextPrompt`` (``{"prompt": str}``) or a ``TokensPrompt``
                (``{"prompt_token_ids": [...]}``), either dict optionally with ``cache_salt``.
            sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar.
            lora_request: a ``pagedllm.lora.request.LoRARequest`` for all prompts, or a list with one
                per prompt (``None``: the base model); needs ``LLM(..., enable_lora=True)``.
            priority: accepted for vLLM's signature; scheduling is first come, first served.
        Returns:
            One finished ``RequestOutput`` per prompt, in input order.
        Raises:
            TypeError: a prompt of another shape (the message names ``prompts[i]``).
            ValueError: a prompt is too long, a text prompt without a tokenizer, a parameter
                list of the wrong length, or a ``lora_request`` refused (adapters off, a bad adapter
                directory: the message names the problem).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
        parsed = [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        params = self._params_per_item(sampling_params, len(parsed))
        loras = _loras_per_item(lora_request, len(parsed))
        return self._run([(p, sp, text, salt, lr) for (p, text, salt), sp, lr in zip(parsed, params, loras)],
                         use_tqdm)

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
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             documents: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate assistant replies for one conversation or a list of them (vLLM's ``LLM.chat``).

        Each conversation is rendered with the chat template (``chat_template``, else the
        tokenizer's; given ``tools`` and ``documents`` in OpenAI's shape when set) and tokenized
        without adding special tokens again. ``continue_final_message`` continues the last
        (assistant) message instead of opening a new one (``add_generation_prompt`` must then
        be False). Parse tool calls and reasoning out of the text with
        ``pagedllm.parsers.parse_whole``.

        ``sampling_params``: one for all conversations or one per conversation;
        ``chat_template_content_format``: accepted for vLLM's signature (text parts are joined;
        image parts, ``image_url`` with a data URL or ``image_pil``, become the model's image
        placeholder before the text, for an image-text model); ``lora_request``: a ``LoRARequest`` for
        all conversations or a list with one per conversation (``None``: the base model), as ``generate``.

        Returns:
            One ``RequestOutput`` per conversation, in input order.
        Raises:
            ValueError: a ``sampling_params`` list of the wrong length, both
                ``continue_final_message`` and ``add_generation_prompt``, a ``lora_request`` refused, or
                an engine built with ``skip_tokenizer_init`` (no chat template to render), an image
                part for a text-only model or one that is not a readable image.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat: needs a tokenizer (the engine was built with skip_tokenizer_init=True)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt=False")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if documents is not None:
            kwargs["documents"] = documents
        items = []
        proc = self.engine.processor
        loras = _loras_per_item(lora_request, len(convs))
        for conv, sp, lora in zip(convs, self._params_per_item(sampling_params, len(convs)), loras):
            conv, media = take_media(conv, {"image": proc.image_placeholder, "video": proc.video_placeholder,
                                            "audio": proc.audio_placeholder}, proc.media_policy, proc.audio_rate)
            text = tok.apply_chat_template(prepare_messages(conv), tools=tools, tokenize=False,
                                           chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)
            prompt = (MultiModalPrompt(text, media["image"], False, media["video"], media["audio"])
                      if any(media.values()) else tok.encode(text, add_special_tokens=False))
            items.append((prompt, sp, text, None, lora))
        return self._run(items, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Embed prompts with a pooling model (vLLM's ``LLM.embed``).

        Args:
            prompts: one prompt or a list, of the shapes ``generate`` takes.
            pooling_params: ``PoolingParams`` for all prompts (default: the model's pooling type and
                normalization, from its sentence-transformers files).
            use_tqdm: show a progress bar.
            truncate_prompt_tokens: overrides ``pooling_params.truncate_prompt_tokens``.
        Returns:
            One ``PoolingRequestOutput`` per prompt, in input order; ``out.outputs.embedding`` is the
            vector (a list of floats).
        Raises:
            ValueError: the model serves generation (not ``--runner pooling``), an empty input, one
                over the model's limit without truncation, or a bad pooling parameter.
        """
        from dataclasses import replace
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        parsed = [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        eng = self.engine
        return self._run_pooling([(lambda rid, p=p: eng.make_pooling_request(rid, p, params), text)
                                  for p, text, _ in parsed], "Embedded prompts", use_tqdm)

    def _run_pooling(self, makers: list, desc: str, use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Build (``maker(request_id)``), queue and run pooling requests; their outputs in order.

        Args:
            makers: ``(maker, prompt text or None)`` per request.
        Raises:
            what the makers raise (nothing is left queued).
        """
        eng = self.engine
        rids = [str(next(self._ids)) for _ in makers]
        try:
            for rid, (make, text) in zip(rids, makers):
                eng.add_prepared(make(rid), text)
            done = self._step_until_done(len(rids), desc, use_tqdm)
        except BaseException:
            eng.abort_request(rids)
            raise
        return [done[r] for r in rids]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None) -> list[ClassificationRequestOutput]:
        """Classify prompts with a cross-encoder (a sequence-classification model; vLLM's ``LLM.classify``).

        Returns:
            One ``ClassificationRequestOutput`` per prompt; ``out.outputs.probs`` per label.
        Raises:
            ValueError: an embedding or generation model, or what ``embed`` raises.
        """
        from dataclasses import replace
        params = replace(pooling_params or PoolingParams(), task="classify")
        outs = self.embed(prompts, params, use_tqdm=use_tqdm)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data), o.prompt_token_ids)
                for o in outs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's ``LLM.score``): a cross-encoder runs each pair as one input
        through its classification head; a bi-encoder gives the cosine similarity of the two texts'
        embeddings.

        ``text_1`` one text and ``text_2`` one or many (1 -> N), or two lists of equal length
        (pairs, N -> N).

        Returns:
            One ``ScoringRequestOutput`` per pair; ``out.outputs.score`` in [-1, 1] (bi-encoder) or
            the classifier's first output after its activation (cross-encoder; ``use_activation=False``
            in ``pooling_params``: the logit).
        Raises:
            ValueError: lists of different lengths, an empty list, or what ``embed`` raises.
        """
        from dataclasses import replace
        left, right = pair_texts(text_1, text_2)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        if self.engine.is_cross_encoder:
            eng, params = self.engine, replace(params, task="score")
            outs = self._run_pooling([(lambda rid, a=a, b=b: eng.make_pair_request(rid, a, b, params), None)
                                      for a, b in zip(left, right)], "Scored pairs", use_tqdm)
            return [ScoringRequestOutput(f"score-{i}", ScoringOutput(o.outputs.data[0]), o.prompt_token_ids)
                    for i, o in enumerate(outs)]
        # each distinct text embedded once (1 -> N repeats text_1); repr keys any prompt shape
        unique = {repr(t): t for t in left + right}
        embs = dict(zip(unique, self.embed(list(unique.values()), params, use_tqdm=use_tqdm)))
        a, b = [embs[repr(t)] for t in left], [embs[repr(t)] for t in right]
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(cosine(x.outputs.data, y.outputs.data)),
                                     x.prompt_token_ids + y.prompt_token_ids) for i, (x, y) in enumerate(zip(a, b))]

    def _step_until_done(self, total: int, desc: str, use_tqdm: bool) -> dict:
        """Step the engine until no request is left; the finished outputs by request id (``total``
        of them expected, for the progress bar)."""
        eng = self.engine
        done: dict = {}
        bar = tqdm(total=total, desc=desc, disable=not use_tqdm)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return done

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        """Add every item (``n`` samples each, as child requests), step to completion, merge the children."""
        eng = self.engine
        groups: list[tuple[str, list[str]]] = []  # (request id, child request ids)
        try:
            for prompt, sp, text, salt, lora in items:
                rid = str(next(self._ids))
                children = [(f"{rid}_{i}", sp.child(i)) for i in range(sp.n)] if sp.n > 1 else [(rid, sp)]
                groups.append((rid, [c for c, _ in children]))
                for cid, csp in children:
                    eng.add_request(cid, prompt, csp, prompt_text=text, cache_salt=salt, lora_request=lora)
            done = self._step_until_done(sum(len(g) for _, g in groups), "Processed prompts", use_tqdm)
        except BaseException:
            eng.abort_request([c for _, g in groups for c in g])  # KeyboardInterrupt or a bad prompt: free every block
            raise
        outs = [merge_samples(rid, [done[c] for c in g]) for rid, g in groups]
        for out, item in zip(outs, items):
            out.lora_request = item[4]
        return outs


def _loras_per_item(lora_request, n: int) -> list:
    """One ``LoRARequest`` (or ``None``) per prompt: the given one for all, or the given list.

    Raises:
        ValueError: a list of the wrong length.
    """
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_request entries for {n} prompts")
    return list(lora_request)


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

