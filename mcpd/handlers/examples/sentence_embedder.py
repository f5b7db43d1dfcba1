"""A sentence embedder: a small BERT-shaped encoder (transformers' BertModel, random weights
from a seed), its last hidden states averaged over each row's real tokens (padding left out)
and L2-normalised. "text" (one UTF-8 string a row) in; "embedding" FP32 [rows, hidden] out."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

from mcpd.handlers.examples.bert_text import BertTextHandler
from mcpd.handlers.tensors import TensorSpec


class SentenceEmbedder(BertTextHandler):
    outputs = {"embedding": TensorSpec("FP32", (-1, -1))}

    def outputs_for(self, values: dict) -> dict[str, TensorSpec]:
        return {"embedding": TensorSpec("FP32", (-1, values["hidden"]))}

    def build_model(self, config: BertConfig) -> torch.nn.Module:
        return BertModel(config, add_pooling_layer=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return {"embedding": mean_pool(hidden, mask)}


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The L2-normalised mean of each row's hidden states where mask is 1."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp(min=1), dim=-1)
