"""A Mixtral-style mixture of experts in place of a Llama layer's MLP: a router picks each token's
top experts, whose SiLU-gated MLPs' outputs are summed weighted by the router's renormalised
probabilities. Module names follow the checkpoints' block_sparse_moe (llama.map_weight fuses each
expert's w1 and w3 into gate_up_proj, as Llama's gate and up)."""
from __future__ import annotations

import torch
from torch import nn

from mcpd.kernels.torch_kernels import TorchKernels


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class MixtureOfExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, experts_per_token: int) -> None:
        super().__init__()
        self.top_k = experts_per_token
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, kernels: TorchKernels) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], in transformers' order: router softmax in float32, each
        chosen expert's rows in expert order, scaled and added in."""
        probs = kernels.linear(x, self.gate.weight).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for index in chosen.unique().tolist():
            rows, slot = torch.where(chosen == index)
            expert = self.experts[index]
            y = kernels.linear(kernels.silu_mul(kernels.linear(x[rows], expert.gate_up_proj.weight)),
                               expert.down_proj.weight)
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out
