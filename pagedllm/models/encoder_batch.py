"""The step layout of an encoder-only model: each prompt whole in one step, no paged cache.

``EncoderBatchBackend`` stands in for an attention backend (its metadata is the step's sequence
boundaries) and ``Padding`` moves the flattened ``[T, ...]`` rows of the step's sequences into a
padded ``[B, L, ...]`` batch and back, for attention (``models/bert.py``) or a whole
``transformers`` model (``models/transformers_encoder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
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


class Padding:
    """Scatter the flattened rows of ``B`` sequences into ``[B, heads, L, d]`` and back.

    Args:
        qsl: ``[B + 1]`` int64 cumulative sequence lengths.
        device: the tensors' device.
    Attributes:
        qsl, lens: ``[B + 1]`` / ``[B]`` int64 numpy cumulative and plain sequence lengths.
        starts: ``[B]`` int64 first row of each sequence.
        mask: ``[B, 1, 1, L]`` bool key mask (True: a real token), or ``None`` when every
            sequence has length ``L``.
    """

    def __init__(self, qsl: np.ndarray, device: torch.device) -> None:
        lens = np.diff(qsl)
        self.qsl, self.lens = qsl, lens
        self.b, self.L = len(lens), int(lens.max())
        seq = np.repeat(np.arange(self.b), lens)
        pos = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], lens)
        self.flat = torch.from_numpy(seq * self.L + pos).to(device)
        self.same = bool((lens == self.L).all())
        m = np.arange(self.L)[None, :] < lens[:, None]
        self.mask = None if self.same else torch.from_numpy(m).to(device)[:, None, None, :]
        self.starts = torch.from_numpy(np.ascontiguousarray(qsl[:-1], dtype=np.int64)).to(device)

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

    def unpad_rows(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, L, H]`` -> ``[T, H]`` (a whole model's ``last_hidden_state`` back to the flattened rows)."""
        h = h.reshape(self.b * self.L, h.shape[-1])
        return h if self.same else h.index_select(0, self.flat)

    def pad_ids(self, ids: torch.Tensor, fill: int) -> torch.Tensor:
        """``[T]`` int64 -> ``[B, L]`` int64 with ``fill`` past each sequence's end."""
        out = ids.new_full((self.b * self.L,), fill)
        out.index_copy_(0, self.flat, ids)
        return out.view(self.b, self.L)

    def attention_mask(self) -> torch.Tensor:
        """``[B, L]`` int64: 1 for a real token, 0 for padding (transformers' ``attention_mask``)."""
        if self.mask is None:
            return torch.ones(self.b, self.L, dtype=torch.int64, device=self.flat.device)
        return self.mask[:, 0, 0, :].long()

    def sequence_of(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 rows of the flattened batch -> ``[N]`` int64 index of the sequence holding each."""
        return torch.searchsorted(self.starts, rows, right=True) - 1


class EncoderModel(nn.Module):
    """What every encoder-only model of the engine shares: no KV cache, no LM head, and a forward
    that hands back the pooled rows (``worker/pooler.py``).

    Subclasses implement ``encode`` (final hidden states of every row) and, for a cross-encoder
    (``num_labels`` > 0), ``classify`` (the classification head's logits per sequence).

    Attributes:
        encoder_only: True (the engine allocates no KV cache and schedules prompts whole).
        num_labels: outputs of the classification head; 0 for an embedding model.
        hidden_size: the embedding size.
    """

    encoder_only = True
    num_labels = 0

    def __init__(self) -> None:
        super().__init__()
        self.attention_backend = EncoderBatchBackend()

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """No KV cache: ``(0 layers, 1, 1)``."""
        return 0, 1, 1

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: Padding,
               token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``[T, hidden]`` final hidden states of the step's rows (after the last layer)."""
        raise NotImplementedError

    def classify(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: Padding,
                 token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``[B, num_labels]`` logits of the classification head, one row per sequence."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: EncoderMetadata,
                logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None):
        """Encode the step's prompts.

        Args:
            input_ids: ``[T]`` int64 token ids of the flattened batch.
            positions: ``[T]`` int64 positions (0-based within each prompt).
            kv_caches: ignored (empty).
            meta: the step's ``EncoderMetadata``.
            logits_indices: must be empty (an encoder has no LM head).
            hidden_indices: ``[N]`` int64 rows whose outputs are returned.
            token_type_ids: ``[T]`` int64 segment of each row (1: the second text of a pair), or
                ``None``: all 0.
        Returns:
            ``(logits [0, 0] float32, out [N, D] float32)``: ``D`` is the hidden size (each row's
            final hidden state) or, for a cross-encoder, ``num_labels`` (the logits of the sequence
            holding the row); only the empty logits when ``hidden_indices`` is ``None``.
        Raises:
            ValueError: logits were asked for.
        """
        if logits_indices.numel():
            raise ValueError("an encoder-only model has no LM head: it serves pooling requests only")
        empty = torch.zeros(0, 0, dtype=torch.float32, device=input_ids.device)
        if hidden_indices is None:
            return empty
        layout = Padding(meta.query_start_loc, input_ids.device)
        if self.num_labels:
            scores = self.classify(input_ids, positions, layout, token_type_ids)
            return empty, scores.index_select(0, layout.sequence_of(hidden_indices)).float()
        return empty, self.encode(input_ids, positions, layout, token_type_ids).index_select(0, hidden_indices).float()
