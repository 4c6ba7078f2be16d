"""Encoder-only models (BERT) for pooling: bidirectional attention over each whole prompt, no KV cache.

The weights and modules are ``transformers``' own ``BertModel`` (loaded with ``from_pretrained``,
float32), but the forward runs on the engine's flattened batch: every linear layer, layer norm
and activation sees the ``[T, hidden]`` rows of all the step's prompts with no padding, and only
attention is computed per sequence (the sequences padded to the longest one, with a key mask,
through ``scaled_dot_product_attention``). So a batch of mixed lengths costs its tokens, not
``batch x longest``; on the CPU the linears run through the same oneDNN-packed weights as the
causal models (``cpu_linear``). The result equals ``BertModel``'s ``last_hidden_state`` up to
float32 rounding (``tests/pooling``).

The scheduler gives an encoder model each prompt whole in one step (bidirectional attention
cannot be chunked) and allocates no KV blocks; ``kv_cache_spec`` reports no layers.
Reference: Devlin et al. 2019 (BERT); transformers' ``modeling_bert.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ENCODER_ARCHITECTURES = ("BertModel",)


def is_encoder_only(config) -> bool:
    """True when ``config`` describes an encoder-only model pagedllm serves for pooling (BERT)."""
    return any(a in ENCODER_ARCHITECTURES for a in (getattr(config, "architectures", None) or ()))


@dataclass
class EncoderMetadata:
    """One step's sequence layout for the encoder.

    Attributes:
        query_start_loc: ``[R + 1]`` int64 numpy cumulative prompt lengths (rows of the flattened batch).
        num_computed: ``[R]`` int64 tokens computed before this step (always 0: prompts come whole).
    """

    query_start_loc: np.ndarray
    num_computed: np.ndarray


class EncoderBatchBackend:
    """The encoder's stand-in for an attention backend: its metadata is the step's sequence
    boundaries (``build_metadata``); there is no paged cache to read."""

    name = "encoder"
    uses_cpu_kernels = False

    def build_metadata(self, batch) -> EncoderMetadata:
        """``EncoderMetadata`` of an ``AttentionBatch``.

        Raises:
            ValueError: a sequence that does not start at token 0 (a chunked prompt).
        """
        if batch.num_computed.size and int(batch.num_computed.max()) != 0:
            raise ValueError("an encoder-only model computes each prompt whole in one step")
        return EncoderMetadata(batch.query_start_loc, batch.num_computed)


class BertEncoderModel(nn.Module):
    """A ``transformers`` ``BertModel`` run on pagedllm's flattened batch (see the module docstring).

    Args:
        hf_model: a loaded ``BertModel`` in eval mode.
    Attributes:
        encoder_only: True (the engine allocates no KV cache and schedules prompts whole).
        hidden_size: the embedding size.
    """

    encoder_only = True

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.attention_backend = EncoderBatchBackend()

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """No KV cache: ``(0 layers, 1, 1)``."""
        return 0, 1, 1

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: EncoderMetadata,
                logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None):
        """Encode the step's prompts.

        Args:
            input_ids: ``[T]`` int64 token ids of the flattened batch.
            positions: ``[T]`` int64 positions (0-based within each prompt).
            kv_caches: ignored (empty).
            meta: the step's ``EncoderMetadata``.
            logits_indices: must be empty (an encoder has no LM head).
            hidden_indices: ``[N]`` int64 rows whose final hidden states are returned.
        Returns:
            ``(logits [0, 0] float32, hidden [N, hidden] float32)``; only the empty logits when
            ``hidden_indices`` is ``None``.
        Raises:
            ValueError: logits were asked for.
        """
        if logits_indices.numel():
            raise ValueError("an encoder-only model has no LM head: it serves pooling requests only")
        empty = torch.zeros(0, 0, dtype=torch.float32, device=input_ids.device)
        if hidden_indices is None:
            return empty
        hf = self.hf
        emb = hf.embeddings
        x = emb.word_embeddings(input_ids) + emb.position_embeddings(positions)
        x = x + emb.token_type_embeddings.weight[0]  # one segment: token type 0
        x = emb.LayerNorm(x)
        layout = _Padding(meta.query_start_loc, input_ids.device)
        for layer in hf.encoder.layer:
            x = self._layer(layer, x, layout)
        return empty, x.index_select(0, hidden_indices).float()

    def _layer(self, layer: nn.Module, x: torch.Tensor, layout: "_Padding") -> torch.Tensor:
        """One BERT layer (post-norm) on ``[T, hidden]`` rows."""
        att = layer.attention
        s = att.self
        t = x.shape[0]
        q, k, v = (layout.pad(p(x).view(t, self.num_heads, self.head_dim)) for p in (s.query, s.key, s.value))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask)  # [B, heads, L, d]
        o = layout.unpad(o).reshape(t, self.hidden_size)
        x = att.output.LayerNorm(att.output.dense(o) + x)
        h = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(x))
        return layer.output.LayerNorm(layer.output.dense(h) + x)


class _Padding:
    """Scatter the flattened rows of ``B`` sequences into ``[B, heads, L, d]`` and back.

    Args:
        qsl: ``[B + 1]`` int64 cumulative sequence lengths.
        device: the tensors' device.
    Attributes:
        mask: ``[B, 1, 1, L]`` bool key mask (True: a real token), or ``None`` when every
            sequence has length ``L``.
    """

    def __init__(self, qsl: np.ndarray, device: torch.device) -> None:
        lens = np.diff(qsl)
        self.b, self.L = len(lens), int(lens.max())
        seq = np.repeat(np.arange(self.b), lens)
        pos = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], lens)
        self.flat = torch.from_numpy(seq * self.L + pos).to(device)
        self.same = bool((lens == self.L).all())
        m = np.arange(self.L)[None, :] < lens[:, None]
        self.mask = None if self.same else torch.from_numpy(m).to(device)[:, None, None, :]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, heads, d]`` -> ``[B, heads, L, d]`` (zeros past each sequence's end)."""
        if self.same:
            return x.view(self.b, self.L, *x.shape[1:]).transpose(1, 2)
        out = x.new_zeros(self.b * self.L, *x.shape[1:])
        out.index_copy_(0, self.flat, x)
        return out.view(self.b, self.L, *x.shape[1:]).transpose(1, 2)

    def unpad(self, o: torch.Tensor) -> torch.Tensor:
        """``[B, heads, L, d]`` -> ``[T, heads, d]``."""
        o = o.transpose(1, 2).reshape(self.b * self.L, *o.shape[1:2], o.shape[3])
        return o if self.same else o.index_select(0, self.flat)


def load_bert_model(model_dir, dtype: torch.dtype, device: torch.device) -> BertEncoderModel:
    """Load ``model_dir`` with ``transformers``' ``BertModel`` (no random init) and wrap it.

    On CPU in float32 its linear layers become oneDNN-packed ``PackedLinear`` (``cpu_linear``).
    """
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging
    # sentence-transformers checkpoints carry BERT's pooler, which pooling does not use: without
    # this, transformers prints a load report calling its two tensors UNEXPECTED at every start
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf = AutoModel.from_pretrained(model_dir, dtype=dtype, add_pooling_layer=False).to(device).eval()
    finally:
        hf_logging.set_verbosity(level)
    from pagedllm.models.cpu_linear import prepack_available, prepack_linears
    if prepack_available(device, dtype):
        logger.info("oneDNN-packed weights: %d linear layers", prepack_linears(hf))
    return BertEncoderModel(hf)
