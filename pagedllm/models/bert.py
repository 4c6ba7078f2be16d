"""Encoder-only models (BERT) for pooling: bidirectional attention over each whole prompt, no KV cache.

The weights and modules are ``transformers``' own ``BertModel`` (loaded with ``from_pretrained``,
float32), but the forward runs on the engine's flattened batch: every linear layer, layer norm
and activation sees the ``[T, hidden]`` rows of all the step's prompts with no padding, and only
attention is computed per sequence (the sequences padded to the longest one, with a key mask,
through ``scaled_dot_product_attention``). So a batch of mixed lengths costs its tokens, not
``batch x longest``; on the CPU the linears run through the same oneDNN-packed weights as the
causal models (``cpu_linear``). The result equals ``BertModel``'s ``last_hidden_state`` up to
float32 rounding (``tests/pooling``). A cross-encoder (``BertForSequenceClassification``) adds
token types (the pair's second text is segment 1) and BERT's pooler and classifier on each
sequence's [CLS] row, equal to the transformers model's ``logits``.

The scheduler gives an encoder model each prompt whole in one step (bidirectional attention
cannot be chunked) and allocates no KV blocks; ``kv_cache_spec`` reports no layers.
Reference: Devlin et al. 2019 (BERT); transformers' ``modeling_bert.py``.
"""

from __future__ import annotations

import logging
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.encoder_batch import EncoderModel, Padding

logger = logging.getLogger(__name__)

class BertEncoderModel(EncoderModel):
    """A ``transformers`` BERT run on pagedllm's flattened batch (see the module docstring).

    Args:
        hf_model: a loaded ``BertModel`` in eval mode.
        head: for a cross-encoder (``BertForSequenceClassification``), its ``(pooler, classifier)``
            modules: ``tanh(dense(h_CLS))`` then the linear classifier; ``None``: an embedding model.
    Attributes:
        hidden_size: the embedding size; num_labels: the classifier's outputs (0 without ``head``).
    """

    def __init__(self, hf_model: nn.Module, head: tuple[nn.Module, nn.Module] | None = None) -> None:
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.head = None if head is None else nn.ModuleList(head)
        self.num_labels = 0 if head is None else int(cfg.num_labels)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: Padding,
               token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``[T, hidden]`` float32 ``last_hidden_state`` rows of the step's prompts."""
        emb = self.hf.embeddings
        x = emb.word_embeddings(input_ids) + emb.position_embeddings(positions)
        x = x + (emb.token_type_embeddings.weight[0] if token_type_ids is None
                 else emb.token_type_embeddings(token_type_ids))
        x = emb.LayerNorm(x)
        for layer in self.hf.encoder.layer:
            x = self._layer(layer, x, layout)
        return x

    def classify(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: Padding,
                 token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``[B, num_labels]`` logits: BERT's pooler on each sequence's [CLS] row, then the classifier."""
        cls = self.encode(input_ids, positions, layout, token_type_ids).index_select(0, layout.starts)
        pooler, classifier = self.head
        return classifier(pooler.activation(pooler.dense(cls)))  # BertPooler: tanh(dense(h_CLS))

    def _layer(self, layer: nn.Module, x: torch.Tensor, layout: Padding) -> torch.Tensor:
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


def load_bert_model(model_dir, dtype: torch.dtype, device: torch.device, prepack: bool = True) -> BertEncoderModel:
    """Load ``model_dir`` with ``transformers``' BERT (no random init) and wrap it: ``BertModel``
    for an embedding model, ``BertForSequenceClassification`` (its pooler and classifier kept as
    the head) for a cross-encoder.

    On CPU in float32 its linear layers become oneDNN-packed ``PackedLinear`` (``cpu_linear``).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from pagedllm.models.encoder_only import is_cross_encoder
    # sentence-transformers checkpoints carry BERT's pooler, which pooling does not use: without
    # this, transformers prints a load report calling its two tensors UNEXPECTED at every start
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if is_cross_encoder(AutoConfig.from_pretrained(model_dir)):
            full = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype).to(device).eval()
            hf, head = full.bert, (full.bert.pooler, full.classifier)
        else:
            hf = AutoModel.from_pretrained(model_dir, dtype=dtype, add_pooling_layer=False).to(device).eval()
            full, head = hf, None
    finally:
        hf_logging.set_verbosity(level)
    from pagedllm.models.cpu_linear import prepack_available, prepack_linears
    if prepack and prepack_available(device, dtype):  # the plan asked, and it applies here
        logger.info("oneDNN-packed weights: %d linear layers", prepack_linears(full))
    return BertEncoderModel(hf, head)
