"""A text classifier: a small BERT-shaped sequence classifier (transformers'
BertForSequenceClassification, random weights from a seed) over the examples' WordPiece ids.
"text" (one UTF-8 string a row) in; each row's "logits" and its "label" (the argmax) out."""
from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification

from mcpd.handlers.examples.bert_text import BertTextHandler
from mcpd.handlers.tensors import TensorSpec


class TextClassifier(BertTextHandler):
    outputs = {"logits": TensorSpec("FP32", (-1, -1)), "label": TensorSpec("INT64", (-1,))}
    extra_settings = {"labels": (2, 2, 4096)}

    def config_extras(self, values: dict) -> dict:
        return {"num_labels": values["labels"]}

    def outputs_for(self, values: dict) -> dict[str, TensorSpec]:
        return {"logits": TensorSpec("FP32", (-1, values["labels"])), "label": TensorSpec("INT64", (-1,))}

    def build_model(self, config: BertConfig) -> torch.nn.Module:
        return BertForSequenceClassification(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        return {"logits": logits, "label": logits.argmax(-1)}
