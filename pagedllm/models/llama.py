"""Native Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2).

Follows the Llama architecture (Touvron et al. 2023) as implemented by
Hugging Face ``transformers``' ``modeling_llama.py``: RMSNorm, rotary position
embeddings (every ``rope_scaling`` type via ``transformers``' RoPE init
functions), grouped-query attention, SwiGLU MLP, optional q/k/v bias (Qwen2),
optional tied embeddings. Q, K and V are one fused matmul, as are gate and up.

Input is one flattened batch ``[num_tokens]`` of every scheduled request's new
tokens; attention goes through the paged KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.selector import select_attention_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import get_pp_size, get_tp_rank, get_tp_size
from pagedllm.models.decode_stack import DecodeStack, matmul_entry, one_sequence
from pagedllm.models.layers import (RMSNorm, RotaryEmbedding, RotaryStep, build_rms_norm, build_rotary,
                                    build_silu_and_mul)
from pagedllm.models.layers.pipeline import (holds_ends, pipeline_finish, pipeline_forward, pipeline_launch, stage_layers,
                                             stage_weights)

__all__ = ["LlamaForCausalLM", "RMSNorm", "RotaryEmbedding"]

# checkpoint projection -> (fused module, piece): how the tensor-parallel loader finds a tensor's place
TP_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def attention_linears(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool,
                      o_bias: bool) -> tuple[nn.Module, nn.Module, int, int]:
    """``(qkv_proj, o_proj, local heads, local KV heads)``: plain ``nn.Linear`` at one rank, else
    column-parallel QKV (whole heads, ``layers.parallel.head_shard``) and a row-parallel output."""
    tp = get_tp_size()
    if tp == 1:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return (nn.Linear(hidden, q + 2 * kv, bias=qkv_bias), nn.Linear(q, hidden, bias=o_bias),
                num_heads, num_kv_heads)
    from pagedllm.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, head_shard
    s, d = head_shard(num_heads, num_kv_heads, tp, get_tp_rank()), head_dim
    kv = (s.kv_start * d, s.kv_heads * d)
    qkv = ColumnParallelLinear(hidden, {"q": (s.q_start * d, s.q_heads * d), "k": kv, "v": kv}, qkv_bias)
    return qkv, RowParallelLinear((s.q_start * d, s.q_heads * d), hidden, o_bias), s.q_heads, s.kv_heads


def mlp_linears(hidden: int, inter: int, bias: bool) -> tuple[nn.Module, nn.Module, int]:
    """``(gate_up_proj, down_proj, local intermediate size)``: plain at one rank, else column-parallel
    gate/up (this rank's share of the intermediate size in both halves) and row-parallel down."""
    tp = get_tp_size()
    if tp == 1:
        return nn.Linear(hidden, 2 * inter, bias=bias), nn.Linear(inter, hidden, bias=bias), inter
    from pagedllm.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, balanced_split
    part = balanced_split(inter, tp, get_tp_rank())
    return (ColumnParallelLinear(hidden, {"gate": part, "up": part}, bias), RowParallelLinear(part, hidden, bias),
            part[1])


def embedding_and_head(vocab: int, hidden: int, tied: bool):
    """``(embed_tokens, lm_head or None when tied, logits function or None)``: plain at one rank, else
    vocabulary-parallel tables and a ``ParallelLogits`` that gathers the logits on rank 0."""
    if get_tp_size() == 1:
        return nn.Embedding(vocab, hidden), None if tied else nn.Linear(hidden, vocab, bias=False), None
    from pagedllm.models.layers.parallel import ParallelLMHead, ParallelLogits, VocabParallelEmbedding
    embed = VocabParallelEmbedding(vocab, hidden)
    head = None if tied else ParallelLMHead(vocab, hidden)
    return embed, head, ParallelLogits(head or embed)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache.

    Args:
        config: the model's ``transformers`` config.
        rotary: the model's rotary embedding (shared by all layers).
        backend: the attention backend chosen at load (shared by all layers).
    """

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # Llama's attention_bias covers q/k/v/o; Qwen2 always has q/k/v bias and no o bias
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias or config.model_type == "qwen2"
        # this rank's heads (all of them at one rank)
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = attention_linears(
            config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, qkv_bias,
            attn_bias and config.model_type != "qwen2")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def forward(self, rope: RotaryStep, x: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; writes this layer's K/V into ``kv_cache``.

        ``rope`` is the step's ``RotaryStep`` (``rotary.prepare``); ``meta`` the backend's metadata.
        """
        qkv = self.qkv_proj(x)
        t = x.shape[0]
        # q and k are adjacent in the fused output: rotate them as one [T, H + KVH, D] tensor
        qk = self.rotary.rotate(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020) with fused gate and up projections.

    Args:
        config: the model's ``transformers`` config.
        cpu_kernels: run the activation in the C kernel (float32 CPU).
    """

    def __init__(self, config, cpu_kernels: bool = False) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj, self.down_proj, self.inter = mlp_linears(config.hidden_size, config.intermediate_size, bias)
        self.act = build_silu_and_mul(cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block (arguments as ``LlamaAttention`` and ``LlamaMLP``)."""

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend, cpu_kernels: bool = False) -> None:
        super().__init__()
        self.input_layernorm = build_rms_norm(config.hidden_size, config.rms_norm_eps, cpu_kernels)
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.post_attention_layernorm = build_rms_norm(config.hidden_size, config.rms_norm_eps, cpu_kernels)
        self.mlp = LlamaMLP(config, cpu_kernels)

    def forward(self, rope: RotaryStep, x, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` ``[T, hidden]`` each -> the same pair for the next layer.

        The hidden state is ``residual + x``; carrying the two apart lets each norm add them
        in its own pass (the first layer gets ``residual=None`` and ``x`` the embeddings).
        """
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened batch and a paged KV cache.

    Args:
        config: a ``transformers`` ``LlamaConfig``/``Qwen2Config``-like object.
        attention_backend: the paged attention backend (``select_attention_backend``); default
            the torch reference on the CPU.
        cpu_kernels: build the norm, rotary and activation layers on the C CPU kernels and run
            batch-1 decode as one fused C call (pass ``kernels.cpu.applies(device, dtype)``).
    """

    def __init__(self, config, attention_backend: AttentionBackend | None = None, cpu_kernels: bool = False) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend or select_attention_backend("cpu", torch.float32, "torch")
        self.cpu_kernels = cpu_kernels
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = build_rotary(config, head_dim, config.max_position_embeddings, cpu_kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tp_size, self.pp_size = get_tp_size(), get_pp_size()
        self.pp_launches = 0  # pipelined steps issued (their messages' tags: layers/pipeline.py)
        # a pipeline stage holds its layers; rank 0 (every rank without a pipeline) also both ends
        self.first_layer, end = stage_layers(config.num_hidden_layers)
        ends = holds_ends()
        embed, head, parallel_logits = (embedding_and_head(config.vocab_size, config.hidden_size,
                                                           self.tie_word_embeddings) if ends else (None, None, None))
        self.embed_tokens = embed
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, self.attention_backend, cpu_kernels)
                                    for _ in range(self.first_layer, end))
        self.norm = build_rms_norm(config.hidden_size, config.rms_norm_eps, cpu_kernels) if ends else None
        self.lm_head = head  # registered last, as before tensor parallelism (parameter order unchanged)
        self.rotary = rotary
        self.packed_head = parallel_logits  # set by ``prepack`` (tensor parallel: gathers the vocabulary shards)
        # batch-1 decode runs the whole stack in one C call (only on the kernel path, see ``forward``)
        self.fused_decode = True
        self._stack: DecodeStack | bool | None = None  # False: a layer the stack cannot run
        self.lora_context = None  # set by ``models.lora_linear.install_lora`` (enable_lora)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the KV cache this model needs."""
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim

    @property
    def supports_step_overlap(self) -> bool:
        """Whether ``forward_launch`` / ``forward_finish`` can keep several steps in flight (a pipeline)."""
        return self.pp_size > 1

    @torch.inference_mode()
    def forward_launch(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                       logits_indices: torch.Tensor):
        """Issue a pipelined step without waiting for its logits (``forward``'s arguments; only with
        ``supports_step_overlap``); returns what ``forward_finish`` takes (``layers/pipeline.py``)."""
        return pipeline_launch(self, input_ids, positions, kv_caches, meta, logits_indices)

    @torch.inference_mode()
    def forward_finish(self, launched) -> torch.Tensor:
        """The logits of a launched step: ``[R, vocab]`` float32 on rank 0, ``[R, 0]`` elsewhere.

        Raises:
            RuntimeError: a pipeline peer failed.
        """
        return pipeline_finish(self, launched)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None,
                lora=None):
        """Run the step.

        Args:
            input_ids: ``[T]`` int64 token ids of the flattened batch.
            positions: ``[T]`` int64 absolute positions.
            kv_caches: per layer ``(key_cache, value_cache)``.
            meta: the attention backend's metadata of the step.
            logits_indices: ``[R]`` int64 rows whose logits are needed.
            hidden_indices: ``[N]`` int64 rows whose final hidden states (after the last norm) are
                needed too (pooling requests), or ``None``.
            lora: the step's ``models.lora_linear.LoRAStep`` (rows per adapter slot), or ``None``
                when no row has an adapter (every forward sets it: ``None`` clears the last step's);
                only with ``install_lora`` done. A step with adapter rows
                never takes the batch-1 C decode stack (it would bypass the adapters).
        Returns:
            ``[R, vocab]`` float32 logits (a pipeline stage other than rank 0: ``[R, 0]``); with ``hidden_indices``,
            ``(logits, [N, hidden] float32)``.
        """
        if self.pp_size > 1:
            return pipeline_forward(self, input_ids, positions, kv_caches, meta, logits_indices)
        if self.lora_context is not None:
            self.lora_context.step = lora
        x = self.embed_tokens(input_ids)
        one = (one_sequence(x.shape[0], meta, kv_caches[0][0].shape[2])
               if self.cpu_kernels and self.fused_decode and lora is None and self._stack_ready() else None)
        if one is not None:
            residual = self._decode_stack(x, int(positions[0]), kv_caches, *one)
        else:
            rope = self.rotary.prepare(positions, x.dtype)
            residual = None
            for layer, kv in zip(self.layers, kv_caches):
                x, residual = layer(rope, x, residual, kv, meta)
        if hidden_indices is None:
            x, _ = self.norm(x.index_select(0, logits_indices), residual.index_select(0, logits_indices))
            return self._logits(x)
        rows = torch.cat([logits_indices, hidden_indices])
        h, _ = self.norm(x.index_select(0, rows), residual.index_select(0, rows))
        r = logits_indices.shape[0]
        logits = self._logits(h[:r]) if r else h.new_zeros(0, self.config.vocab_size)
        return logits, h[r:].float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` float32 logits of final hidden states ``x`` ``[R, hidden]``."""
        if self.packed_head is not None:
            return self.packed_head(x).float()
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w).float()

    def _stack_ready(self) -> bool:
        """Whether every layer's products can run in the C stack (packed ``GGUFLinear`` or float32
        weights; not e.g. Q2_K's or 16-bit layers); builds the ``DecodeStack`` the first time."""
        if self._stack is None:
            mods = [m for layer in self.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            if any(matmul_entry(m) is None for m in mods):
                self._stack = False
                return False
            attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
            # addresses change only if the cache or the weights are replaced
            self._stack = DecodeStack(self._stack_rows, lambda kv: (kv[0][0].data_ptr(), id(attn.qkv_proj)),
                                      (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.inter,
                                       self.layers[0].input_layernorm.eps, attn.scale, "silu", None))
        return self._stack is not False

    def _decode_stack(self, x: torch.Tensor, position: int, kv_caches, block_table: torch.Tensor,
                      seq_len: int) -> torch.Tensor:
        """The last ``T`` tokens of one sequence through all layers in one C call
        (``models/decode_stack``); ``x`` ``[T, hidden]`` becomes the last MLP output; returns
        the residual stream ``[T, hidden]``. ``position``: the first token's. The C call writes the
        tokens' K/V itself.
        """
        rows = slice(position, position + x.shape[0])
        return self._stack.run(x, kv_caches, self.rotary.cos[rows], self.rotary.sin[rows], block_table, seq_len)

    def _stack_rows(self, kv_caches) -> list[dict]:
        """``kernels.cpu.stack_table``'s rows of the layers: fused q|k|v and gate|up products."""
        rows = []
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            a, m = layer.self_attn, layer.mlp
            mms = {"q": a.qkv_proj, "o": a.o_proj, "gate": m.gate_up_proj, "down": m.down_proj}
            rows.append({"in_norm": layer.input_layernorm.weight, "pre_ff_norm": layer.post_attention_layernorm.weight,
                         "post_attn_norm": None, "post_ff_norm": None, "q_norm": None, "k_norm": None,
                         "key_cache": kc, "value_cache": vc, "rope": 0, "window": 0,
                         "matmuls": {k: matmul_entry(v) for k, v in mms.items()}})
        return rows

    def prepack(self) -> int:
        """Give every linear layer, the LM head included, a oneDNN-packed weight
        (``pagedllm.models.cpu_linear``); returns how many layers got one."""
        from pagedllm.models.cpu_linear import PackedLinear, prepack_linears
        n = prepack_linears(self.layers)
        if self.packed_head is not None:  # already served from packed GGUF blocks
            return n
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_head = PackedLinear(w, None)
        return n + 1

    def load_weights(self, weights) -> None:
        """Copy Hugging Face-named tensors into the fused modules.

        Args:
            weights: iterable of ``(name, tensor)`` with ``transformers`` Llama names.
        Raises:
            KeyError: a parameter is missing from, or unknown to, the checkpoint.
        """
        if self.pp_size > 1:  # this stage's tensors, renamed to its local layer indices
            weights = stage_weights(self, weights)
        if self.tp_size > 1:  # each rank copies only its rows / columns
            from pagedllm.models.layers.parallel import load_parallel_weights
            return load_parallel_weights(self, weights, TP_FUSED, {"lm_head.weight"} if self.lm_head is None else ())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        attn0 = self.layers[0].self_attn
        q, kv = attn0.q_size, attn0.kv_size
        shard = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, None), "up_proj": ("gate_up_proj", 1, None)}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            target = name
            if len(parts) >= 2 and parts[-2] in shard:
                fused, start, size = shard[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                dst = params[target].data
                if size is None:  # gate/up: equal halves
                    half = dst.shape[0] // 2
                    start, size = start * half, half
                dst[start:start + size].copy_(tensor)
                loaded.add(f"{target}#{start}")
                continue
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            params[target].data.copy_(tensor)
            loaded.add(target)
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise KeyError(f"checkpoint lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
