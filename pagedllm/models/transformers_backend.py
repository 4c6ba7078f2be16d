"""The Transformers backend: any ``transformers`` causal LM, run with pagedllm's paged attention.

pagedllm's attention is registered in ``transformers``' ``AttentionInterface``
under the name ``"pagedllm"``, and the model is loaded with
``attn_implementation="pagedllm"``. The model's own code then runs unchanged
(embeddings, rotary or learned positions, norms, MLPs, soft-capping), and every
attention module calls ``paged_attention_forward``, which hands the step's
Q/K/V to the attention backend chosen at load (``attention/backend.py``): it
writes the K/V into the module's layer of the paged cache and reads the
contexts. No ``transformers`` KV cache object exists (``use_cache=False``)
and no attention mask is built (custom attention gets none). The flattened
batch is one sequence of ``num_tokens`` rows; positions come from the
scheduler through ``position_ids``.

Hybrid models (``models/hybrid.py``: LFM2, Granite 4, Bamba, Jamba): the mixer layers that carry
fixed-size state run pagedllm's replacement ``forward``, which reads and writes the
request's state slot through the step's ``StateBatch``; only the attention layers
get paged KV cache layers (``kv_index`` maps a model layer to its cache layer).

Reference: transformers' "Attention interface" documentation.
"""

from __future__ import annotations

import inspect

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.state import StateBatch
from pagedllm.models.decode_stack import one_sequence
from pagedllm.models.transformers_lora import TransformersLoRAMixin
from pagedllm.models.transformers_vision import (AUDIO_MODEL_TYPES, MROPE_MODEL_TYPES, VisionMixin, is_mm_prefix_model,
                                                 is_multimodal_model, is_prefix_lm, is_vision_model)
from pagedllm.models.hf_config import num_kv_heads
from pagedllm.models.hybrid import (attention_layer_indices, hybrid_family, install_mixers, layer_kinds,
                                    state_cache_spec)

logger = logging.getLogger(__name__)

ATTN_NAME = "pagedllm"


@dataclass
class _StepContext:
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    kv_index: list[int]
    state: StateBatch | None = None


_current: _StepContext | None = None  # the step being run (one engine thread runs steps)


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``transformers`` attention function backed by the paged KV cache.

    Args:
        module: the attention module; ``module.layer_idx`` picks the cache layer.
        query: ``[1, num_heads, num_tokens, head_dim]``.
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]`` of the step's tokens.
        attention_mask: ignored (always ``None`` for a custom implementation).
        scaling: softmax scale (default ``head_dim ** -0.5``).
        sliding_window: the layer's window in tokens, or ``None``.
        softcap: attention logit soft-capping, or ``None``.
    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)`` as transformers' attention functions.
    Raises:
        RuntimeError: called outside a pagedllm step.
        ValueError: the module asks for bidirectional attention, or passes a position bias.
    """
    ctx = _current
    if ctx is None:
        raise RuntimeError("pagedllm attention called outside an engine step")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__} asks for bidirectional attention; pagedllm attention is causal")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} passes {name!r} ({_UNSUPPORTED_KWARGS[name]}), "
                             f"which pagedllm attention does not implement")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    cache = ctx.kv_caches[ctx.kv_index[module.layer_idx]]
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")  # gpt-oss
    out = ctx.backend.forward(q, k.contiguous(), v.contiguous(), cache, ctx.meta, scale,
                              sliding_window=sliding_window, softcap=softcap,
                              sinks=None if sinks is None else sinks.detach().float())
    return out.unsqueeze(0), None


# attention arguments that change the result and that the attention backends do not implement
_UNSUPPORTED_KWARGS = {"position_bias": "relative position bias"}

# ``layer_types`` entries whose only state is the attention K/V of their tokens (what the paged cache
# holds); MLP kinds carry no state. Anything else (convolution, linear/recurrent attention, chunked
# or sparse attention, ...) needs state or masking that the backend does not have.
_SERVABLE_LAYER_TYPES = {"full_attention", "sliding_attention", "dense", "sparse"}


def register() -> None:
    """Register ``paged_attention_forward`` as ``attn_implementation="pagedllm"`` (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _auto_class(config):
    """``transformers``' auto class for ``config``: image-text-to-text for ``VISION_MODEL_TYPES``,
    multimodal-LM for ``AUDIO_MODEL_TYPES`` (Qwen2-Audio, Voxtral)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM
    if is_vision_model(config):
        return AutoModelForImageTextToText
    return AutoModelForMultimodalLM if is_multimodal_model(config) else AutoModelForCausalLM


def _attn_implementation(config):
    """Our attention for the language model; a vision tower or audio encoder keeps ``sdpa``
    (bidirectional, no KV cache)."""
    if not is_multimodal_model(config):
        return ATTN_NAME
    top = "sdpa" if config.model_type in AUDIO_MODEL_TYPES else ATTN_NAME  # Qwen2-Audio's class takes no other
    return {"text_config": ATTN_NAME, "vision_config": "sdpa", "audio_config": "sdpa", "": top}


def check_supported(config) -> type:
    """The ``transformers`` class that would serve ``config``.

    Raises:
        ValueError: ``transformers`` has no causal LM for the config, that model's
            attention cannot be replaced (``_supports_attention_backend`` is False and no hybrid
            family vouches for it: ``HybridFamily.vouches_attention``), the
            config asks for bidirectional attention, or it has layers other than full or
            sliding-window attention (``layer_types``), except the state layers of a hybrid
            family pagedllm serves (``models/hybrid.py``).
    """
    try:
        cls = _auto_class(config)._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"transformers {__import__('transformers').__version__} has no causal LM for "
                         f"model_type {config.model_type!r}") from None
    text = _text_config(config)
    fam = hybrid_family(text)
    # an audio-text model's own class has no attention of its own: its language model's class is what runs ours
    from transformers import AutoModelForCausalLM
    lm = (AutoModelForCausalLM._model_mapping.get(type(text), cls) if config.model_type in AUDIO_MODEL_TYPES
          else cls)
    if not (getattr(lm, "_supports_attention_backend", False) or (fam is not None and fam.vouches_attention)):
        raise ValueError(f"{cls.__name__} does not take a custom attention implementation "
                         f"(_supports_attention_backend is False), so the Transformers backend cannot serve it")
    bidirectional = getattr(text, "is_causal", True) is False or getattr(text, "use_bidirectional_attention", False)
    if bidirectional and not is_prefix_lm(config):  # a prefix-LM's two ways are the runner's spans
        raise ValueError(f"{cls.__name__} is configured for bidirectional attention; pagedllm serves causal LMs only")
    other = sorted(set(layer_kinds(text)) - _SERVABLE_LAYER_TYPES
                   - (fam.state_layer_types | fam.plain_layer_types if fam is not None else frozenset()))
    if other:
        raise ValueError(f"{cls.__name__} has {other} layers; the Transformers backend serves full and "
                         f"sliding-window attention layers only (their state is not a paged KV cache)")
    return cls


def _check_modules(hf: nn.Module, backend: AttentionBackend) -> None:
    """Reject a loaded model whose decoder attention is bidirectional, or uses sinks the attention
    backend does not implement.

    Raises:
        ValueError: a module with a ``layer_idx`` on our attention (the decoder's) has
            ``is_causal=False`` (e.g. BERT without ``is_decoder``; a prefix-LM's are allowed: its two
            ways are the runner's prompt span, ``is_prefix_lm``), or a ``sinks`` tensor (gpt-oss)
            where ``backend.supports_sinks`` is False.
    """
    prefix_lm = is_prefix_lm(getattr(hf, "config", None))
    for name, mod in hf.named_modules():
        if not hasattr(mod, "layer_idx"):
            continue
        if getattr(getattr(mod, "config", None), "_attn_implementation", ATTN_NAME) != ATTN_NAME:
            continue  # an encoder on its own attention (Qwen2-Audio's audio tower: sdpa), not ours
        if getattr(mod, "is_causal", True) is False and not prefix_lm:
            raise ValueError(f"{type(hf).__name__}: {name} is bidirectional (is_causal=False), not a causal LM; "
                             f"pagedllm attention is causal")
        if isinstance(getattr(mod, "sinks", None), torch.Tensor) and not backend.supports_sinks:
            raise ValueError(f"{type(hf).__name__}: {name} uses attention sinks, which the {backend.name} attention "
                             f"does not implement")


class TransformersCausalLM(VisionMixin, TransformersLoRAMixin, nn.Module):
    """A ``transformers`` causal LM behind pagedllm's model interface.

    Args:
        hf_model: a model loaded with ``attn_implementation="pagedllm"``.
        attention_backend: the paged attention backend its attention modules call.
        heads: this rank's ``(query heads, KV heads)`` when the model is split over
            tensor-parallel ranks (``transformers_tp.shard_transformers_model``), else ``None``
            (the config's counts).
    """

    def __init__(self, hf_model: nn.Module, attention_backend: AttentionBackend,
                 heads: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.hf = hf_model
        self.attention_backend = attention_backend
        cfg = _text_config(hf_model.config)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads, self.num_kv_heads = heads or (cfg.num_attention_heads, num_kv_heads(cfg))
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn = attention_layer_indices(cfg)
        self.kv_index = [-1] * self.num_layers  # model layer -> paged cache layer (-1: a state or plain layer)
        for j, i in enumerate(attn):
            self.kv_index[i] = j
        self.num_kv_layers = len(attn)
        self._state_spec = state_cache_spec(cfg)
        self.decode_stack = None  # set by ``load_transformers_model`` where the C stack applies
        self.is_multimodal = is_multimodal_model(hf_model.config)  # images, audio: encode_image, forward(mm=...)
        self.realtime = getattr(hf_model.config, "model_type", None) == "voxtral_realtime"  # _realtime_logits
        self.keeps_logits = "logits_to_keep" in inspect.signature(type(hf_model).forward).parameters
        self.mrope = getattr(hf_model.config, "model_type", None) in MROPE_MODEL_TYPES  # rope_positions
        self.mm_prefix_attention = is_mm_prefix_model(hf_model.config)  # within an image: both ways
        self.prefix_lm = is_prefix_lm(hf_model.config)  # the whole prompt both ways (PaliGemma)
        if self.prefix_lm:  # its two ways are the runner's prompt span; our attention is causal beyond it
            for mod in hf_model.modules():
                if hasattr(mod, "layer_idx") and getattr(mod, "is_causal", True) is False:
                    mod.is_causal = True
        if self._state_spec:
            install_mixers(hf_model, cfg, self._step_state)

    @staticmethod
    def _step_state() -> StateBatch:
        if _current is None or _current.state is None:
            raise RuntimeError("a pagedllm state mixer ran outside an engine step with a StateBatch")
        return _current.state

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the KV cache (attention layers only)."""
        return self.num_kv_layers, self.num_kv_heads, self.head_dim

    def state_cache_spec(self) -> dict[int, list[tuple[int, ...]]]:
        """Model layer -> per-slot shapes of its recurrent-state tensors (``{}``: attention only)."""
        return self._state_spec

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None,
                state: StateBatch | None = None, mm=None, rope_positions: torch.Tensor | None = None, lora=None):
        """Run one step (same contract as the native models).

        Args:
            input_ids: ``[T]`` int64 token ids of the flattened batch.
            positions: ``[T]`` int64 absolute positions.
            kv_caches: per layer ``(key_cache, value_cache)``.
            meta: the attention backend's metadata of the step.
            logits_indices: ``[R]`` int64 rows whose logits are needed (only those are projected).
            hidden_indices: ``[N]`` int64 rows whose final hidden states (the last entry of
                ``hidden_states``: after the final norm) are needed too (pooling), or ``None``.
            state: the step's state slots (hybrid models; ``attention/state.py``), else ``None``.
            mm: the step's images (``worker.multimodal_step.MultiModalStep``): the model then runs
                on input embeddings with the image rows written over their placeholders.
            rope_positions: ``[3, T]`` int64 M-RoPE positions (``self.mrope``, a step with a request
                that has images: ``EncoderCache.rope_positions``), in place of ``positions``.
            lora: the step's ``models.lora_linear.LoRAStep`` (``None``: no adapter rows), for the
                decoder's ``LoRALinear`` wrappers (``transformers_lora``); such a step never takes the
                batch-1 C decode stack (it would bypass them).
        Returns:
            ``[R, vocab]`` float32 logits (after the model's own final soft-capping, if any); with
            ``hidden_indices``, ``(logits, [N, hidden] float32)``.
        """
        global _current
        if self.lora_context is not None:  # every forward sets it: None clears the last step's
            self.lora_context.step = lora
        if self.decode_stack is not None and lora is None and hidden_indices is None and state is None and mm is None:
            one = one_sequence(input_ids.shape[0], meta, kv_caches[0][0].shape[2])
            if one is not None:  # batch-1 decode: the whole stack in one C call (transformers_stack)
                return self.decode_stack.logits(input_ids, positions, kv_caches, logits_indices, *one)
        _current = _StepContext(self.attention_backend, kv_caches, meta, self.kv_index, state)
        want_hidden = hidden_indices is not None
        try:
            tokens = ({"input_ids": input_ids.unsqueeze(0)} if mm is None
                      else {"inputs_embeds": mm.embeds(self, input_ids).unsqueeze(0)})
            pos = positions.unsqueeze(0) if rope_positions is None else rope_positions.unsqueeze(1)
            if mm is not None and mm.moves:  # videos pruned by EVS: their rows' positions, known after embeds
                pos = mm.positions(pos)
            if self.realtime:  # Voxtral Realtime: its language model takes the time conditioning
                embeds = tokens["inputs_embeds"] if mm is not None else self.embed_tokens(input_ids)[None]
                return self._realtime_logits(embeds, pos, logits_indices, hidden_indices)
            if mm is not None and mm.deepstack is not None:
                return self._deepstack_logits(tokens["inputs_embeds"], pos, mm.deepstack, logits_indices, hidden_indices)
            if not self.keeps_logits:  # a forward without logits_to_keep (Qwen2-Audio's): the rows by hand
                return self._selected_logits(tokens, pos, logits_indices, hidden_indices)
            out = self.hf(**tokens, position_ids=pos, use_cache=False,
                          logits_to_keep=logits_indices, return_dict=True, output_hidden_states=want_hidden)
        finally:
            _current = None
        logits = out.logits[0].float()
        if not want_hidden:
            return logits
        return logits, out.hidden_states[-1][0].index_select(0, hidden_indices).float()


def load_transformers_model(model_dir, config, dtype: torch.dtype, device: torch.device,
                            attention_backend: AttentionBackend, prepack: bool = True,
                            quantization: str = "none", kernel_norms: bool = False,
                            expert_parallel: bool = False) -> TransformersCausalLM:
    """Load ``model_dir`` with ``transformers`` and pagedllm attention through ``attention_backend``.

    ``from_pretrained`` builds the model on the meta device and loads the
    safetensors weights into place, so there is no random init and no second copy.
    On CPU in float32 its ``nn.Linear`` layers become ``PackedLinear`` (``cpu_linear``).
    On a rank of a tensor-parallel group the loaded model is split by its ``tp_plan``
    (``transformers_tp.shard_transformers_model``) before any weight is read: built with its
    parameters on the meta device, split, then filled with this rank's slices only
    (``transformers_tp_load.load_sharded``); it runs plain torch linears. With ``quantization``
    ``gguf`` or ``int8`` (one rank, C kernels on) the linear layers, embedding and LM head are served
    packed instead (``packed_transformers``); with ``kernel_norms`` (the C kernels on) its RMSNorms
    run on the C kernel where it reproduces them (``transformers_norms``). With ``expert_parallel``
    (``--enable-expert-parallel``) a tensor-parallel rank holds whole experts (``moe.shard_experts``).

    Raises:
        ValueError: see ``check_supported``, ``_check_modules`` and, with several tensor-parallel
            ranks, ``transformers_tp.tensor_parallel_plan`` (checked before any weight is read).
    """
    from transformers import AutoModelForCausalLM

    from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
    check_supported(config)
    tp = get_tp_size()
    if tp > 1:  # refuse an unsplittable model before reading its weights
        from pagedllm.models.transformers_tp import tensor_parallel_plan
        tensor_parallel_plan(_text_config(config), tp, expert_parallel)
    register()
    if tp > 1:
        return _load_tensor_parallel(model_dir, config, dtype, device, attention_backend, expert_parallel)
    formats = None
    from pagedllm.models.gguf_experts import read_manifest
    if quantization in ("gguf", "int8") or read_manifest(model_dir):
        # packed layers built from the files, never in float32; experts left in a GGUF file are read
        # from it (from_pretrained would not find them)
        from pagedllm.models.transformers_tp_load import load_sharded, parameters_on_meta
        with parameters_on_meta():
            hf = _auto_class(config).from_config(config, dtype=dtype, attn_implementation=_attn_implementation(config))
        _check_modules(hf, attention_backend)
        if quantization in ("gguf", "int8"):
            formats = _serve_packed(hf, model_dir, quantization)
        load_sharded(hf, model_dir, device)  # the parameters left (norms, float layers), whole
    else:
        hf = _auto_class(config).from_pretrained(model_dir, dtype=dtype, attn_implementation=_attn_implementation(config))
        _check_modules(hf, attention_backend)
    hf = hf.to(device).eval()
    from pagedllm.models.cpu_linear import prepack_available, prepack_linears
    if prepack and prepack_available(device, dtype):  # the plan asked, and it applies here
        # the same oneDNN-packed linears (and batch-1 kernel) as the native models
        prepack_linears(hf)
    model = TransformersCausalLM(hf, attention_backend)
    if kernel_norms:  # after the hybrid mixers are installed: they keep their own (gated) norms
        from pagedllm.models.transformers_norms import install_kernel_norms
        replaced, kept = install_kernel_norms(hf)
        logger.info("RMSNorm modules on the C kernel: %d (%d kept: no match)", replaced, kept)
        from pagedllm.models import moe
        if (n := moe.install(hf)):
            logger.info("mixture-of-experts: %d expert layers on the C experts kernel (models/moe.py)", n)
        if not model._state_spec and model.num_kv_layers == model.num_layers:
            from pagedllm.models.transformers_stack import plan_decode_stack
            model.decode_stack = plan_decode_stack(hf, (model.num_heads, model.num_kv_heads, model.head_dim))
            logger.info("batch-1 decode: %s", "one C call over the layers (transformers_stack)"
                        if model.decode_stack is not None else "the model's own modules, layer by layer")
    if formats is not None:
        model.quantization = formats  # ``/stats`` ``weight_formats``
    return model


def _load_tensor_parallel(model_dir, config, dtype: torch.dtype, device: torch.device,
                          attention_backend: AttentionBackend, expert_parallel: bool) -> TransformersCausalLM:
    """This rank's part of the model: torch linears on its slices (as the native model's parallel
    layers), its whole experts with ``expert_parallel``; built on meta, split, then filled."""
    from transformers import AutoModelForCausalLM

    from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
    from pagedllm.models import moe
    from pagedllm.models.transformers_tp import shard_transformers_model
    from pagedllm.models.transformers_tp_load import load_sharded, parameters_on_meta
    with parameters_on_meta():
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_NAME)
    _check_modules(hf, attention_backend)
    shard = shard_transformers_model(hf, _text_config(hf.config), get_tp_size(), get_tp_rank(), expert_parallel)
    load_sharded(hf, model_dir, device)  # this rank's slices only (transformers_tp_load.py)
    if (n := moe.install_expert_parallel(hf)):
        logger.info("expert parallel: %d MoE layers; (first expert, experts, of all) on this rank: %s", n,
                    next(m.pagedllm_ep for m in hf.modules() if getattr(m, "pagedllm_ep", None)))
    hf = hf.to(device).eval()
    return TransformersCausalLM(hf, attention_backend, (shard.q_heads, shard.kv_heads))


def _serve_packed(hf: nn.Module, model_dir, quantization: str) -> dict[str, int]:
    """Swap the linears (and embedding, LM head) of ``hf``, built on meta, for packed ones read from
    ``model_dir`` (and its GGUF source); ``{format: layers}``.

    Raises:
        ValueError: ``gguf`` for a directory that was not converted from a GGUF file still on disk.
    """
    from pagedllm.memory import return_freed_memory
    from pagedllm.models import packed_transformers as packed
    from pagedllm.models.quant_linear import gguf_source, quantized_kernels
    if quantization == "gguf":
        src = gguf_source(model_dir)
        if src is None:
            raise ValueError(f"quantization='gguf': {model_dir} was not converted from a GGUF file (or the file "
                             "moved); use quantization='none'")
        counts, nbytes = packed.pack_from_gguf(hf, model_dir, src, _text_config(hf.config))
        what = f"GGUF blocks served packed from {src.name}"
    else:
        counts, nbytes = packed.pack_int8(hf, model_dir)
        what = "int8 weights (per output channel)"
    return_freed_memory()  # the GGUF reader's and the quantizer's scratch
    logger.info("%s (Transformers backend): %s; kernels: %s", what, packed.describe(counts, nbytes),
                quantized_kernels())
    return counts
