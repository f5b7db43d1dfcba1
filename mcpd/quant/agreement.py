"""How closely one model's next-token distributions follow another's (a quantized variant's
against its float model): top-1 agreement and mean KL divergence, teacher-forced.

Both models read the same token sequences (a prompt and the reference model's greedy
continuation) and predict every next token; each position counts once. Teacher forcing measures
the models where they are compared, position by position: free-running, one early divergence
would make every later position a comparison of two different texts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcpd.models.layers import AttentionMetadata, bind_kv_cache

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1: float      # share of positions where both models' most likely next token is the same
    mean_kl: float   # mean KL(reference || candidate) of the next-token distributions, in nats
    reference_top1_prob: float   # mean probability of reference's most likely token: how peaked
                                 # its distributions are (near 1 / vocab for random weights)


@torch.inference_mode()
def position_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab]: model's next-token prediction after each prefix,
    from one prefill of the sequence into a KV cache of its own (bound to model, replacing any)."""
    weight = model.weights.final_norm
    blocks = -(-len(token_ids) // BLOCK_SIZE)
    cache = torch.zeros(blocks, model.num_layers, 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim,
                        dtype=weight.dtype, device=weight.device)
    bind_kv_cache(model, cache)
    attn = AttentionMetadata.build([list(range(blocks))], [0], [len(token_ids)], BLOCK_SIZE, weight.device)
    hidden = model(torch.tensor(token_ids, device=weight.device), attn.positions, attn)
    return model.compute_logits(hidden)


def compare(reference, candidate, sequences: list[list[int]]) -> Agreement:
    """Agreement of candidate's next-token distributions with reference's over sequences."""
    matches, kl_sum, top1_prob_sum, positions = 0, 0.0, 0.0, 0
    for tokens in sequences:
        ref = position_logits(reference, tokens).log_softmax(-1)
        cand = position_logits(candidate, tokens).log_softmax(-1)
        matches += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        kl_sum += float(F.kl_div(cand, ref, log_target=True, reduction="sum"))
        top1_prob_sum += float(ref.amax(-1).exp().sum())
        positions += len(tokens)
    return Agreement(positions, matches / positions, kl_sum / positions, top1_prob_sum / positions)
