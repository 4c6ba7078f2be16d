"""Encoder-only models other than BERT, through ``transformers``' own modules (the Transformers
backend for pooling).

Any built-in encoder family (RoBERTa, XLM-RoBERTa, DistilBERT, DeBERTa, ELECTRA, MPNet,
ModernBERT, ...; ``encoder_only.ENCODER_MODEL_TYPES``) is loaded with ``AutoModel`` (an
embedding model) or ``AutoModelForSequenceClassification`` (a cross-encoder) and run on the
step's prompts, grouped by length and each group padded to its longest with an
``attention_mask`` (``PADDING_SLACK``), so every family's own
position rule (RoBERTa counts positions from ``pad_token_id + 1``), embeddings, attention and
head apply unchanged. The engine still schedules each prompt whole in one step under the token
budget; the padded rows are the cost of running a model we did not rewrite (BERT runs natively
on the flattened batch, ``models/bert.py``). Results equal the transformers model's
``last_hidden_state`` / ``logits`` up to float32 rounding (``tests/pooling``).
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import torch
from torch import nn

from pagedllm.models.encoder_batch import EncoderModel, Padding

logger = logging.getLogger(__name__)

# a group of the step's sequences is padded to at most this many times its real tokens
PADDING_SLACK = 1.25


class TransformersEncoderModel(EncoderModel):
    """A ``transformers`` encoder (or sequence classifier) run on the step's padded prompts.

    Args:
        hf_model: a loaded ``AutoModel`` or ``AutoModelForSequenceClassification`` in eval mode.
        classifier: ``hf_model`` is a sequence classifier (its ``logits`` are the output).
    Attributes:
        hidden_size: the embedding size; num_labels: the classifier's outputs (0 for an embedding model).
    """

    def __init__(self, hf_model: nn.Module, classifier: bool) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = cfg = hf_model.config
        self.hidden_size = cfg.hidden_size
        self.num_labels = int(cfg.num_labels) if classifier else 0
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        params = inspect.signature(hf_model.forward).parameters
        # DistilBERT and a few others have no segments; BERT-like ones take them when pairs have them
        self.takes_token_types = "token_type_ids" in params and int(getattr(cfg, "type_vocab_size", 1) or 1) > 1

    def _inputs(self, input_ids: torch.Tensor, layout: Padding, token_type_ids: torch.Tensor | None) -> dict:
        """The padded ``[B, L]`` keyword arguments of the transformers forward."""
        kw = {"input_ids": layout.pad_ids(input_ids, self.pad_id), "attention_mask": layout.attention_mask()}
        if self.takes_token_types and token_type_ids is not None:
            kw["token_type_ids"] = layout.pad_ids(token_type_ids, 0)
        return kw

    def _by_length(self, input_ids: torch.Tensor, layout: Padding, token_type_ids: torch.Tensor | None):
        """Yield ``(sequence indices [b] int64, row indices [t] int64, transformers output)`` per group
        of sequences of similar length: the step's prompts come in arrival order, and one padded
        batch of mixed lengths would cost ``B x longest`` (sentence-transformers sorts by length too)."""
        order = np.argsort(layout.lens, kind="stable")
        groups, cur, real = [], [], 0
        for i in order.tolist():  # ascending: a group's longest is its last
            n = int(layout.lens[i])
            if cur and (len(cur) + 1) * n > PADDING_SLACK * (real + n):
                groups.append(cur)
                cur, real = [], 0
            cur.append(i)
            real += n
        groups.append(cur)
        for g in groups:
            seqs = np.array(g, dtype=np.int64)
            rows = np.concatenate([np.arange(layout.qsl[i], layout.qsl[i + 1]) for i in g])
            sub_qsl = np.zeros(len(g) + 1, dtype=np.int64)
            np.cumsum(layout.lens[seqs], out=sub_qsl[1:])
            sub = Padding(sub_qsl, input_ids.device)
            r = torch.from_numpy(rows).to(input_ids.device)
            types = None if token_type_ids is None else token_type_ids.index_select(0, r)
            yield seqs, r, sub, self.hf(**self._inputs(input_ids.index_select(0, r), sub, types))

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: Padding,
               token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``[T, hidden]`` float32 ``last_hidden_state`` rows (positions come from the model's own rule)."""
        out = None
        for _, rows, sub, res in self._by_length(input_ids, layout, token_type_ids):
            h = sub.unpad_rows(res.last_hidden_state)
            out = h.new_empty(input_ids.shape[0], h.shape[-1]) if out is None else out
            out.index_copy_(0, rows, h)
        return out

    def classify(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: Padding,
                 token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``[B, num_labels]`` float32 ``logits`` of the transformers classification model."""
        out = None
        for seqs, _, _, res in self._by_length(input_ids, layout, token_type_ids):
            out = res.logits.new_empty(layout.b, res.logits.shape[-1]) if out is None else out
            out.index_copy_(0, torch.from_numpy(seqs).to(out.device), res.logits)
        return out


def load_transformers_encoder(model_dir, config, dtype: torch.dtype, device: torch.device,
                              prepack: bool = True) -> TransformersEncoderModel:
    """Load an encoder-only ``model_dir`` with ``transformers`` (``AutoModel``, or
    ``AutoModelForSequenceClassification`` for a cross-encoder) and wrap it.

    Raises:
        ModelLoadError: transformers cannot build the model from the directory (one line naming it).
    """
    from transformers import AutoModel, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from pagedllm.models.encoder_only import is_cross_encoder
    from pagedllm.models.loader import ModelLoadError
    classifier = is_cross_encoder(config)
    cls = AutoModelForSequenceClassification if classifier else AutoModel
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # sentence-transformers checkpoints carry an unused pooler
    try:
        hf = cls.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(model_dir, f"transformers could not load this encoder: {e}") from None
    finally:
        hf_logging.set_verbosity(level)
    from pagedllm.models.cpu_linear import prepack_available, prepack_linears
    if prepack and prepack_available(device, dtype):  # the plan asked, and it applies here
        logger.info("oneDNN-packed weights: %d linear layers", prepack_linears(hf))
    return TransformersEncoderModel(hf, classifier)
