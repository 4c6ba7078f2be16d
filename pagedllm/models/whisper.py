"""Whisper, the encoder-decoder, on the paged KV cache (issue 42).

A request's sequence is its clip's ``encoder_rows`` placeholder tokens, then the decoder's tokens
(``multimodal_whisper``). The clip is an encoder input as any other: the runner's encoder step runs
``encode_image`` (the model's own ``WhisperEncoder``, ``sdpa``) and writes the rows over the
placeholders. This model then turns the step's encoder rows into every decoder layer's
cross-attention keys and values, once, written into that layer's cache at the placeholders' slots:
the "cross blocks" are the request's first blocks, beside its decoder's. Decoder rows run the
model's own ``WhisperDecoder``: its self-attention through pagedllm's paged attention
(``transformers_backend.paged_attention_forward``) over the blocks after the cross blocks, its
cross-attention (``_cross_attention``, replacing the module's forward) a query against the cached
cross K/V, which are never projected again.

``step_metadata`` (the runner's metadata strategy for this model) cuts one step into the three
layouts: the encoder rows' writes, the decoder's causal self-attention (positions from the first
decoder token, the block table shifted by the cross blocks) and its cross-attention (each decoder
row sees the request's ``max_source_positions`` encoder rows). They are built by the chosen attention
backend's own ``build_metadata``, so every backend serves Whisper.

Source: transformers' ``WhisperForConditionalGeneration`` (the modules run unchanged but the
cross-attention's K/V projections); vLLM's encoder-decoder KV cache (cross-attention K/V computed
once per request and held in blocks) as documented.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionBatch, AttentionMetadata
from pagedllm.models import transformers_backend as tb
from pagedllm.multimodal_whisper import encoder_rows

logger = logging.getLogger(__name__)


@dataclass
class WhisperMetadata:
    """One step's attention layouts for Whisper (``WhisperModel.step_metadata``).

    Attributes:
        enc_rows: ``[Te]`` int64 rows of the flattened batch that are encoder rows (placeholders).
        dec_rows: ``[Td]`` int64 rows that are decoder tokens.
        dec_of_row: ``[T]`` int64 each row's index among ``dec_rows`` (-1: an encoder row).
        enc_write: the backend's metadata writing the encoder rows' K/V (``slot_mapping`` only read),
            or ``None``.
        self_meta: the decoder rows' causal self-attention over the decoder's blocks, or ``None``.
        cross_meta: each decoder row as a one-token query over its request's encoder rows, or ``None``.
    """

    enc_rows: torch.Tensor
    dec_rows: torch.Tensor
    dec_of_row: torch.Tensor
    enc_write: AttentionMetadata | None
    self_meta: AttentionMetadata | None
    cross_meta: AttentionMetadata | None


@dataclass
class _CrossContext:
    backend: AttentionBackend
    kv_caches: list
    meta: AttentionMetadata


_cross: _CrossContext | None = None  # the step being run (one engine thread runs steps)


def _cross_attention(module: nn.Module, hidden_states: torch.Tensor, key_value_states=None, past_key_values=None,
                     attention_mask=None, output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """A decoder layer's cross-attention (``WhisperAttention.forward`` with ``key_value_states``) over the
    request's cached encoder K/V: ``hidden_states`` ``[1, Td, d_model]`` -> ``([1, Td, d_model], None)``.
    The query is scaled before the product, as transformers' Whisper does (its numerics).

    Raises:
        RuntimeError: called outside a pagedllm step.
    """
    ctx = _cross
    if ctx is None:
        raise RuntimeError("Whisper cross-attention called outside a pagedllm step")
    n = hidden_states.shape[1]
    q = (module.q_proj(hidden_states[0]) * module.scaling).view(n, module.num_heads, module.head_dim)
    out = ctx.backend.attend(q, ctx.kv_caches[module.layer_idx], ctx.meta, 1.0)
    return module.out_proj(out.reshape(1, n, -1)), None


class WhisperModel(nn.Module):
    """``WhisperForConditionalGeneration`` behind pagedllm's model interface (``forward`` as the
    Transformers backend's, ``encode_image`` / ``embed_tokens`` for the runner's encoder step).

    Args:
        hf_model: the model loaded with ``attn_implementation="sdpa"`` (its encoder keeps it; the
            decoder's self-attention modules are moved onto pagedllm's attention here).
        attention_backend: the paged attention backend.
    """

    is_multimodal = True  # the runner's encoder step and encoder cache
    mrope = False
    mm_prefix_attention = False
    prefix_lm = False

    def __init__(self, hf_model: nn.Module, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.hf = hf_model
        self.attention_backend = attention_backend
        cfg = hf_model.config
        self.num_layers = cfg.decoder_layers
        self.num_heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // cfg.decoder_attention_heads
        self.enc_len = int(cfg.max_source_positions)
        self.enc_rows = encoder_rows(cfg)
        paged = copy.copy(cfg)  # the decoder's self-attention reads its implementation from its config
        paged._attn_implementation = tb.ATTN_NAME
        for layer in hf_model.model.decoder.layers:
            layer.self_attn.config = paged
            layer.encoder_attn.forward = _cross_attention.__get__(layer.encoder_attn)
        self._kv_index = list(range(self.num_layers))

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(decoder layers, heads, head_dim)``: one cache layer per decoder layer, holding its
        cross-attention K/V in the cross blocks and its self-attention K/V after them."""
        return self.num_layers, self.num_heads, self.head_dim

    def state_cache_spec(self) -> dict:
        """No recurrent state."""
        return {}

    def encode_image(self, features: torch.Tensor, **extra) -> torch.Tensor:
        """Clips' encoder rows: ``features`` ``[N, mel bins, 3000]`` log-mel (the feature extractor's,
        30 s) -> ``[N * enc_rows, d_model]`` (each clip's ``max_source_positions`` rows after the encoder's
        final norm, then zero rows up to ``enc_rows``)."""
        p = next(self.hf.parameters())
        rows = self.hf.model.encoder(features.to(p.device, p.dtype)).last_hidden_state
        pad = rows.new_zeros(rows.shape[0], self.enc_rows - rows.shape[1], rows.shape[2])
        return torch.cat([rows, pad], dim=1).reshape(-1, rows.shape[2])

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, d_model]`` decoder token embeddings (a tensor of its own)."""
        return self.hf.model.decoder.embed_tokens(input_ids).clone()

    def step_metadata(self, backend: AttentionBackend, batch: AttentionBatch) -> WhisperMetadata:
        """The step's three layouts (``WhisperMetadata``) from the runner's ``AttentionBatch``.

        Raises:
            ValueError: a block size that does not divide ``enc_rows`` (the decoder's blocks would not
                start on a block).
        """
        bs = batch.block_size
        if self.enc_rows % bs:
            raise ValueError(f"--block-size {bs}: Whisper needs a power of two up to {self.enc_rows}")
        qsl, start, end = batch.query_start_loc, batch.num_computed, batch.seq_lens
        n = qsl[1:] - qsl[:-1]
        req = np.repeat(np.arange(n.size), n)
        pos = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
        enc = np.flatnonzero(pos < self.enc_rows)
        dec = np.flatnonzero(pos >= self.enc_rows)
        dec_of_row = np.full(pos.size, -1, dtype=np.int64)
        dec_of_row[dec] = np.arange(dec.size)
        rows = batch.rows[req]
        enc_write = self_meta = cross_meta = None
        if enc.size:  # each encoder row as a one-token write (only its slot is read)
            enc_write = backend.build_metadata(_one_token_batch(batch, rows[enc], batch.slot_mapping[enc], 1))
        if dec.size:
            e = self.enc_rows
            nd = np.bincount(req[dec], minlength=n.size)
            has = np.flatnonzero(nd)
            dqsl = np.concatenate(([0], np.cumsum(nd[has]))).astype(np.int64)
            self_meta = backend.build_metadata(AttentionBatch(
                query_start_loc=dqsl, num_computed=np.maximum(start[has] - e, 0), seq_lens=end[has] - e,
                slot_mapping=batch.slot_mapping[dec], block_table=batch.block_table[:, e // bs:],
                rows=batch.rows[has], block_size=bs))
            cross_meta = backend.build_metadata(_one_token_batch(batch, rows[dec], np.zeros(dec.size, np.int64),
                                                                 self.enc_len))
        dev = backend.device
        return WhisperMetadata(torch.from_numpy(enc).to(dev), torch.from_numpy(dec).to(dev),
                               torch.from_numpy(dec_of_row).to(dev), enc_write, self_meta, cross_meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: WhisperMetadata,
                logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None, state=None, mm=None,
                rope_positions=None) -> torch.Tensor:
        """Run one step: write the step's encoder rows' cross-attention K/V, then the decoder on its rows.

        Args:
            input_ids: ``[T]`` int64; positions: ``[T]`` int64 (decoder rows: ``enc_rows`` + their
                decoder position); kv_caches: per decoder layer ``(key_cache, value_cache)``;
            meta: ``step_metadata``'s; logits_indices: ``[R]`` int64 rows whose logits are needed;
            mm: the step's clips (``worker.multimodal_step.MultiModalStep``), or ``None``.
        Returns:
            ``[R, vocab]`` float32 logits (an encoder row's are zeros: it predicts nothing).
        Raises:
            ValueError: ``hidden_indices`` (Whisper is not served for pooling).
        """
        if hidden_indices is not None:
            raise ValueError("Whisper is served for transcription, not pooling")
        x = mm.embeds(self, input_ids) if mm is not None else self.embed_tokens(input_ids)
        if meta.enc_write is not None:
            self._write_cross(x.index_select(0, meta.enc_rows), kv_caches, meta.enc_write)
        logits = x.new_zeros(logits_indices.shape[0], self.hf.config.vocab_size, dtype=torch.float32)
        if meta.self_meta is None:
            return logits
        idx = meta.dec_of_row.index_select(0, logits_indices)
        keep = torch.nonzero(idx >= 0).reshape(-1)
        hidden = self._decode(x.index_select(0, meta.dec_rows), positions.index_select(0, meta.dec_rows) - self.enc_rows,
                              kv_caches, meta)
        logits[keep] = self.hf.proj_out(hidden.index_select(0, idx.index_select(0, keep))).float()
        return logits

    def _write_cross(self, rows: torch.Tensor, kv_caches: list, write: AttentionMetadata) -> None:
        """Each decoder layer's cross-attention K/V of the encoder ``rows`` ``[Te, d_model]`` into its cache."""
        n = rows.shape[0]
        for i, layer in enumerate(self.hf.model.decoder.layers):
            attn = layer.encoder_attn
            k = attn.k_proj(rows).view(n, self.num_heads, self.head_dim)
            v = attn.v_proj(rows).view(n, self.num_heads, self.head_dim)
            self.attention_backend.write_kv(k, v, kv_caches[i], write)

    def _decode(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: WhisperMetadata) -> torch.Tensor:
        """The decoder on its rows ``[Td, d_model]`` at decoder ``positions`` ``[Td]``: ``[Td, d_model]``
        after its final norm."""
        global _cross
        tb._current = tb._StepContext(self.attention_backend, kv_caches, meta.self_meta, self._kv_index)
        _cross = _CrossContext(self.attention_backend, kv_caches, meta.cross_meta)
        try:
            # encoder_hidden_states only switches the layers' cross-attention on: ours reads the cache
            out = self.hf.model.decoder(inputs_embeds=embeds[None], position_ids=positions[None],
                                        encoder_hidden_states=embeds[None, :1], use_cache=False)
        finally:
            tb._current = None
            _cross = None
        return out.last_hidden_state[0]


def _one_token_batch(batch: AttentionBatch, rows: np.ndarray, slots: np.ndarray, seq_len: int) -> AttentionBatch:
    """Each of ``rows`` (block-table rows) as a one-token request of ``seq_len`` tokens writing to ``slots``."""
    k = rows.size
    return AttentionBatch(query_start_loc=np.arange(k + 1, dtype=np.int64),
                          num_computed=np.full(k, seq_len - 1, dtype=np.int64),
                          seq_lens=np.full(k, seq_len, dtype=np.int64), slot_mapping=slots.astype(np.int64),
                          block_table=batch.block_table, rows=rows.astype(np.int64), block_size=batch.block_size)


def load_whisper_model(model_dir, config, dtype: torch.dtype, device: torch.device,
                       attention_backend: AttentionBackend) -> WhisperModel:
    """Load a Whisper directory with ``transformers`` (``from_pretrained``: no random init, no second
    copy) and put its decoder on pagedllm's attention.

    Raises:
        ValueError: not a ``WhisperForConditionalGeneration`` config.
    """
    from transformers import WhisperForConditionalGeneration
    if getattr(config, "model_type", None) != "whisper":
        raise ValueError(f"not a Whisper config: model_type {getattr(config, 'model_type', None)!r}")
    tb.register()
    hf = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    from pagedllm.models.cpu_linear import prepack_available, prepack_linears
    if prepack_available(device, dtype):  # oneDNN-packed linears (and the batch-1 kernel) as the other models
        prepack_linears(hf)
    logger.info("Whisper: %d encoder / %d decoder layers; cross-attention K/V in the paged cache (%d rows a clip)",
                config.encoder_layers, config.decoder_layers, encoder_rows(config))
    return WhisperModel(hf, attention_backend)
