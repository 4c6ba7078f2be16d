"""The front end's request processor: tokenize, validate and resolve defaults into one
``EngineCoreRequest`` (vLLM's ``Processor``), the only way requests are made.

Runs anywhere (no engine state is touched), so the server calls it on its tokenizer thread (and
``check_structured_outputs`` on its grammar thread first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace

from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.multimodal_inputs import MultiModalPrompt, PreparedPrompt
from pagedllm.pooling_params import PoolerConfig, PoolingParams
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.structured_output.params import StructuredOutputError


logger = logging.getLogger(__name__)

REFUSED_KEPT = 1024  # refused grammars remembered (hash -> reason), so a resent one costs no compile


class PromptTooLongError(SamplingParamError):
    """Prompt plus ``max_tokens`` exceeds the context limit (``param`` is ``max_tokens`` or ``prompt``)."""


class WrongRunnerError(SamplingParamError):
    """A generation request to a pooling model, or a pooling request to a generation model."""


# a pooling request samples nothing; this is what its scheduler ``Request`` carries
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


class Processor:
    """Turns a prompt and ``SamplingParams`` (or ``PoolingParams``) into an ``EngineCoreRequest``.

    Args:
        tokenizer: the model's ``transformers`` tokenizer.
        vocab_size: the model's vocabulary size (token ids must be below it).
        context_limit: most tokens (prompt + output) one request may reach.
        pooler_config: the model's pooling defaults when it is served for pooling (``--runner
            pooling``, or an encoder model); ``None``: a generation model.
        multimodal: an image-text model's processor (``multimodal.MultiModalProcessor``), else ``None``.
        lora_checker: the ``lora.checker.AdapterChecker`` a request's ``lora_request`` passes
            (``None``: a request with one is refused).
    """

    def __init__(self, tokenizer, vocab_size: int, context_limit: int,
                 pooler_config: PoolerConfig | None = None, multimodal=None, lora_checker=None) -> None:
        self.lora_checker = lora_checker
        self.tokenizer, self.vocab_size, self.context_limit = tokenizer, vocab_size, context_limit
        self.pooler_config = pooler_config
        self.multimodal = multimodal
        self._validator = None  # the grammar validator (a child process), built with the first constrained request
        self._fallback = None  # an in-process backend, only where the child cannot start
        self._validator_lock = threading.Lock()
        self._memo_lock = threading.Lock()  # the front end's threads share what was checked
        self._valid_grammars: set[str] = set()
        self._refused: OrderedDict[str, str] = OrderedDict()  # grammar hash -> why (the last REFUSED_KEPT)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Check a request's structured-output constraint, so that nothing the core cannot compile
        reaches it: the cheap bounds of ``structured_output.limits`` (size, nesting, ``$ref`` and rule
        chains) while its spec is built, then a compile and first token mask exactly as the core's, in
        the validator's child process (``structured_output.validator``: a timeout or a crash there is a
        refusal, and nothing else is hurt). Grammars seen before are answered from memory (by hash).
        Thread-safe: the server calls it on its own grammar thread before ``process``, which then finds
        the grammar checked.

        Raises:
            SamplingParamError: ``param`` names the constraint (``structured_outputs.json``, ...).
        """
        so = params.structured_outputs
        if so is None:
            return
        if self.tokenizer is None:
            raise SamplingParamError(so.param, f"{so.param}: structured outputs need a tokenizer (the engine was "
                                     "built with skip_tokenizer_init=True)")
        try:
            key = so.grammar_key()
        except StructuredOutputError as e:
            raise SamplingParamError(e.param, str(e)) from None
        if key in self._valid_grammars:
            return
        with self._memo_lock:
            err = self._refused.get(key)
        if err is None:
            err = self._validate(so.grammar_spec())
        with self._memo_lock:
            if err:
                self._refused[key] = err
                while len(self._refused) > REFUSED_KEPT:
                    self._refused.popitem(last=False)
            else:
                if len(self._valid_grammars) > 4096:
                    self._valid_grammars.clear()
                self._valid_grammars.add(key)
        if err:
            raise SamplingParamError(so.param, f"{so.param}: {err}")

    def _validate(self, spec: str) -> str | None:
        """Why ``spec`` does not compile, or ``None`` (the validator child; in process, after the
        limits, only where no child process can be started)."""
        from pagedllm.structured_output.validator import GrammarValidator, ValidatorUnavailable
        with self._validator_lock:
            if self._validator is None:
                try:
                    self._validator = GrammarValidator(self.tokenizer, self.vocab_size)
                except ValueError as e:  # a slow tokenizer
                    return str(e)
        try:
            return self._validator.check(spec)
        except ValidatorUnavailable as e:
            from pagedllm.structured_output.backend import GuidanceBackend
            logger.warning("%s; checking this grammar in process", e)
            with self._validator_lock:
                if self._fallback is None:
                    self._fallback = GuidanceBackend(self.tokenizer, self.vocab_size, set())
            return self._fallback.validate(spec)

    def close(self) -> None:
        """Stop the grammar validator's child process, if one runs (the next check starts another)."""
        if self._validator is not None:
            self._validator.close()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (special tokens as the tokenizer adds them), or the ids as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SamplingParamError("prompt", "prompt: a text prompt needs a tokenizer; this engine was "
                                         "built with skip_tokenizer_init=True (give token ids)")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None, cache_salt: str | None = None,
                lora_request=None) -> EngineCoreRequest:
        """Tokenize and validate; ``lora_request``: the ``LoRARequest`` it runs with, or ``None``.

        Raises:
            PromptTooLongError: prompt + max_tokens exceed the context limit (``param`` names which).
            SamplingParamError: an empty prompt, token ids outside the vocabulary (prompt,
                ``logit_bias``, ``stop_token_ids``), ``min_tokens`` above the effective ``max_tokens``,
                or a structured-output constraint that does not compile.
            WrongRunnerError: the model is served for pooling.
            ValueError: a ``lora_request`` the adapter check refuses (``lora.checker.AdapterChecker``).
        """
        if lora_request is not None:
            if self.lora_checker is None:
                raise ValueError("lora_request: LoRA adapters need an engine built with enable_lora=True")
            self.lora_checker.check(lora_request)
        if self.pooler_config is not None:
            answers = ("/score, /rerank and /classify (a cross-encoder)" if self.pooler_config.is_cross_encoder
                       else "/v1/embeddings, /pooling, /score and /rerank")
            raise WrongRunnerError("model", f"This model is served for pooling (--runner pooling): it answers "
                                   f"{answers}, not text generation")
        ids, mm_inputs = self._prompt_ids(prompt, params)
        vocab = self.vocab_size
        if params.truncate_prompt_tokens is not None:  # keep the end: the question, not the preamble
            keep = self.context_limit - (params.max_tokens or 1) if params.truncate_prompt_tokens == -1 \
                else params.truncate_prompt_tokens
            ids = ids[-max(keep, 1):]
        if not ids:
            raise SamplingParamError("prompt", "prompt: must contain at least one token")
        # an image's placeholder may lie past the vocabulary (embedded from the image, never looked up:
        # a text-only Gemma 3 with llama.cpp's mmproj)
        text_ids = ids if not mm_inputs else [t for t in ids if t != self.multimodal.image_token_id]
        if text_ids and (min(text_ids) < 0 or max(text_ids) >= vocab):
            raise SamplingParamError("prompt", f"prompt: token ids must be in [0, {vocab})")
        bad_bias = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad_bias:
            raise SamplingParamError("logit_bias", f"logit_bias: token ids must be in [0, {vocab}), got {bad_bias[0]}")
        bad_allowed = [t for t in params.allowed_token_ids or () if t >= vocab]
        if bad_allowed:
            raise SamplingParamError("allowed_token_ids", f"allowed_token_ids: token ids must be in [0, {vocab}), "
                                     f"got {bad_allowed[0]}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids: token ids must be in [0, {vocab}), "
                                     f"got {bad_stop[0]}")
        limit = self.context_limit
        if len(ids) >= limit:
            asked = "" if params.max_tokens is None else f" and requested max_tokens={params.max_tokens}"
            raise PromptTooLongError("prompt", f"This model's maximum context length is {limit} tokens. "
                                     f"However, your prompt has {len(ids)} tokens{asked}.")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        last = max((m for m in mm_inputs or () if m.additive), key=lambda m: m.end, default=None)
        if last is not None:  # Voxtral Realtime: a token per audio frame, generation ends with the audio
            max_tokens = min(max_tokens, last.end + last.open - len(ids))
        if len(ids) + max_tokens > limit:
            raise PromptTooLongError("max_tokens", f"This model's maximum context length is {limit} tokens. "
                                     f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the "
                                     f"prompt, {max_tokens} for max_tokens). Please reduce the length.")
        self.check_structured_outputs(params)
        if self.tokenizer is None and params.stop:
            raise SamplingParamError("stop", "stop: stop strings need a tokenizer (the engine was built with "
                                     "skip_tokenizer_init=True); use stop_token_ids")
        if params.min_tokens > max_tokens:  # without max_tokens the bound is what the context leaves
            raise SamplingParamError("min_tokens", f"min_tokens: must be <= max_tokens={max_tokens} (the "
                                     f"context limit less the prompt when max_tokens is not set), got "
                                     f"{params.min_tokens}")
        arrival = arrival_time if arrival_time is not None else time.time()
        return EngineCoreRequest(request_id, ids, params, max_tokens, arrival, cache_salt, mm_inputs=mm_inputs,
                                 lora_request=lora_request)

    @property
    def image_placeholder(self) -> str | None:
        """The text that stands for one image in a prompt (LLaVA's ``<image>``); ``None``: a text model."""
        return None if self.multimodal is None else self.multimodal.image_placeholder

    @property
    def video_placeholder(self) -> str | None:
        """The text that stands for one video (Qwen-VL's ``<|vision_start|><|video_pad|><|vision_end|>``);
        ``None``: the model takes no video."""
        return None if self.multimodal is None else self.multimodal.video_placeholder

    @property
    def audio_placeholder(self) -> str | None:
        """The text that stands for one audio clip (Qwen2-Audio's ``<|audio_bos|><|AUDIO|><|audio_eos|>``);
        ``None``: the model takes no audio."""
        return None if self.multimodal is None or self.multimodal.audio is None else self.multimodal.audio.placeholder

    @property
    def audio_rate(self) -> int | None:
        """Samples per second the model's clips are decoded at (``None``: no audio)."""
        mm = self.multimodal
        return None if mm is None or mm.audio is None else int(mm.processor.feature_extractor.sampling_rate)

    @property
    def media_policy(self):
        """Where image and video URLs may point (``media.MediaPolicy``); ``None``: a text model."""
        return None if self.multimodal is None else self.multimodal.policy

    def _prompt_ids(self, prompt, params: SamplingParams) -> tuple[list[int], list]:
        """``(ids, images)``: a text or ids as ``tokenize``; a ``MultiModalPrompt`` through the model's
        processor (placeholders expanded, one ``MultiModalInput`` per image); a ``PreparedPrompt`` (a
        realtime stream's next request, made by the model's processor) as it is.

        Raises:
            SamplingParamError: images for a text-only model (``multi_modal_data``), with
                ``truncate_prompt_tokens`` (it would cut placeholders), or images the processor
                refuses (too many, not matching the text's image tokens).
        """
        if isinstance(prompt, PreparedPrompt) and self.multimodal is not None:  # a realtime stream's next request
            return list(prompt.ids), list(prompt.inputs)
        if not isinstance(prompt, MultiModalPrompt):
            if getattr(self.multimodal, "needs_media", False):  # Whisper: its decoder reads a clip's encoder rows
                raise SamplingParamError("prompt", "prompt: this model transcribes audio; give a clip in "
                                         "multi_modal_data (or use /v1/audio/transcriptions)")
            return self.tokenize(prompt), []
        if self.multimodal is None:
            raise SamplingParamError("multi_modal_data", "multi_modal_data: this model reads text only")
        if params.truncate_prompt_tokens is not None:
            raise SamplingParamError("truncate_prompt_tokens", "truncate_prompt_tokens: not with images (it would "
                                     "cut an image's placeholder tokens)")
        try:
            return self.multimodal(prompt, "multi_modal_data")
        except ValueError as exc:
            raise SamplingParamError("multi_modal_data", str(exc)) from None

    def process_pooling(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                        arrival_time: float | None = None, cache_salt: str | None = None) -> EngineCoreRequest:
        """Tokenize, truncate and validate a pooling request (vLLM's pooling API).

        A text is tokenized with the tokenizer's special tokens (BERT's ``[CLS] ... [SEP]``);
        with ``truncate_prompt_tokens`` it is cut to that many tokens by the tokenizer (its
        truncation side, special tokens kept), token ids on the same side.

        Raises:
            WrongRunnerError: the model is served for generation (``param`` ``model``).
            SamplingParamError: an empty input (``param`` ``input``), token ids outside the
                vocabulary, or a bad pooling parameter (``param`` names it).
            PromptTooLongError: the input is longer than the model takes (``param`` ``input``; the
                message names the limit and ``truncate_prompt_tokens``).
        """
        params, keep = self._pooling_params(params)
        cross = self.pooler_config.is_cross_encoder
        if cross and params.task == "embed":
            raise WrongRunnerError("model", "This model is a cross-encoder (a classification head): it answers "
                                   "/score, /rerank and /classify, not embeddings")
        if not cross and params.task == "classify":
            raise WrongRunnerError("model", "This model makes embeddings; classification needs a model with a "
                                   "sequence-classification head")
        return self._pooling_request(request_id, self._pooling_ids(prompt, keep), params, arrival_time, cache_salt)

    def process_pair(self, request_id: str, text_1: str, text_2: str, params: PoolingParams,
                     arrival_time: float | None = None) -> EngineCoreRequest:
        """Tokenize a cross-encoder's pair as one input (vLLM's score API for classification models):
        the tokenizer's pair encoding (BERT: ``[CLS] a [SEP] b [SEP]``, the second text token type 1),
        cut by ``truncate_prompt_tokens`` with the tokenizer's ``longest_first`` rule.

        Raises:
            WrongRunnerError: the model is not a cross-encoder, or its head has more than one label
                (``param`` ``model``).
            SamplingParamError, PromptTooLongError: as ``process_pooling`` (``param`` ``text_1`` or
                ``text_2``: the empty one, or the longer of an over-long pair).
        """
        params, keep = self._pooling_params(params)
        if not self.pooler_config.is_cross_encoder:
            raise WrongRunnerError("model", "pairs are scored as one input by a cross-encoder only; this model "
                                   "embeds each text (a bi-encoder)")
        if self.pooler_config.num_labels != 1:  # which label would be "the" score is not ours to guess
            raise WrongRunnerError("model", f"This cross-encoder has {self.pooler_config.num_labels} labels; a score "
                                   "needs one (a relevance model). Use /classify (LLM.classify) for its label "
                                   "probabilities")
        if self.tokenizer is None:
            raise SamplingParamError("text_1", "text_1: scoring pairs needs a tokenizer (the engine was built with "
                                     "skip_tokenizer_init=True)")
        for name, text in (("text_1", text_1), ("text_2", text_2)):
            if not isinstance(text, str) or not text:
                raise SamplingParamError(name, f"{name}: a cross-encoder scores non-empty texts")
        enc = (self.tokenizer(text_1, text_2) if keep is None
               else self.tokenizer(text_1, text_2, truncation="longest_first", max_length=keep))
        types = list(enc.get("token_type_ids") or ())
        first = types.index(1) if 1 in types else None
        longer = "text_2" if len(text_2) >= len(text_1) else "text_1"  # an over-long pair: blame the longer text
        return self._pooling_request(request_id, list(enc["input_ids"]), replace(params, token_type_start=first),
                                     arrival_time, None, longer)

    def _pooling_params(self, params: PoolingParams) -> tuple[PoolingParams, int | None]:
        """Validated, resolved params and the token count to keep (``None``: no truncation).

        Raises:
            WrongRunnerError: a generation model.
        """
        if self.pooler_config is None:
            raise WrongRunnerError("model", "This model serves text generation; start it with --runner pooling "
                                   "(vLLM: --task embed) to serve embeddings")
        params = params.validate().resolved(self.pooler_config)
        limit = self.context_limit
        keep = params.truncate_prompt_tokens
        return params, limit if keep == -1 else None if keep is None else min(keep, limit)

    def _pooling_request(self, request_id: str, ids: list[int], params: PoolingParams, arrival_time: float | None,
                         cache_salt: str | None, param: str = "input") -> EngineCoreRequest:
        """Check a pooling input's ids against the vocabulary and the limit; the ``EngineCoreRequest``."""
        limit = self.context_limit
        if not ids:
            raise SamplingParamError(param, f"{param}: must contain at least one token (got an empty input)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise SamplingParamError(param, f"{param}: token ids must be in [0, {self.vocab_size})")
        if len(ids) > limit:
            raise PromptTooLongError(param, f"This model's maximum input length is {limit} tokens. However, your "
                                     f"input has {len(ids)} tokens. Shorten it, or set truncate_prompt_tokens "
                                     f"(-1 truncates to the limit).")
        arrival = arrival_time if arrival_time is not None else time.time()
        return EngineCoreRequest(request_id, ids, _POOLING_SAMPLING, 1, arrival, cache_salt, params)

    def _pooling_ids(self, prompt: str | list[int], keep: int | None) -> list[int]:
        """Token ids of a pooling input, cut to ``keep`` tokens on the tokenizer's truncation side."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return self.tokenize(prompt)  # raises: no tokenizer
            if prompt == "":
                return []
            if keep is None:
                return self.tokenizer.encode(prompt)
            return self.tokenizer.encode(prompt, truncation=True, max_length=keep)
        ids = list(prompt)
        if keep is None or len(ids) <= keep:
            return ids
        left = getattr(self.tokenizer, "truncation_side", "right") == "left"
        return ids[-keep:] if left else ids[:keep]
