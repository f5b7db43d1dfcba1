"""Next-token choice for a batch: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Sampling uses the exponential race: argmax(probs / E) with E ~ Exp(1) per token draws a token with
probability proportional to probs, so the whole batch samples with one argmax and the randomness
is just the noise tensor. A seeded request draws its noise row from a generator re-seeded with
(seed, position of the token being sampled): the draw then depends on nothing else, so the same
seed and prompt give the same tokens whatever else is in the batch, and after a preemption.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from mcpd.engine.sequence import Sequence

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit multiplier: spreads (seed, position) pairs apart


class Sampler:
    def __init__(self, device: torch.device, argmax: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """argmax: the model's kernels' (kernels.TorchKernels.argmax), each row's greedy token."""
        self.device, self.argmax = device, argmax
        self.seeded = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
        """logits: float32 [S, vocab], one row per sequence. Returns chosen tokens and, if any
        sequence asked, the log-probability of each under the distribution it was drawn from."""
        params = [s.params for s in seqs]
        greedy_tokens = self.argmax(logits)
        if all(p.greedy for p in params):
            tokens, processed = greedy_tokens, logits
        else:
            processed = self._process(logits, params)
            noise = torch.empty_like(processed).exponential_()
            for row, seq in enumerate(seqs):
                if seq.params.seed is not None:
                    position = len(seq.token_ids)  # of the token being drawn
                    self.seeded.manual_seed((seq.params.seed * _GOLDEN + position) % 2**64)
                    noise[row].exponential_(generator=self.seeded)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 would turn a banned token's 0/0 into NaN
            sampled = (processed.softmax(dim=-1) / noise).argmax(dim=-1)
            greedy = torch.tensor([p.greedy for p in params], device=self.device)
            tokens = torch.where(greedy, greedy_tokens, sampled)
            processed = torch.where(greedy[:, None], logits, processed)
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = processed.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), logprobs

    def _process(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Temperature, then top-k, then top-p on what is left (the order transformers uses).

        The logits are shifted so that each row's largest is 0 before the division: the
        distribution is the same, and a temperature so small that logit / temperature would
        overflow (1e-38 and below) divides into 0 for the best token and -inf for the rest, the
        limit of a temperature going to 0: greedy, with finite logprobs, never NaN."""
        temperature = torch.tensor([p.temperature or 1.0 for p in params], device=self.device)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
        if all(p.top_k == 0 and p.top_p == 1.0 for p in params):
            return logits
        vocab = logits.shape[-1]
        # A top_k beyond the vocabulary keeps everything (and must not overflow int64).
        top_k = torch.tensor([min(p.top_k, vocab) or vocab for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], device=self.device)
        ranked, order = logits.sort(dim=-1, descending=True)
        ranked = ranked.masked_fill(torch.arange(vocab, device=self.device) >= top_k[:, None], float("-inf"))
        probs = ranked.softmax(dim=-1)
        # Drop a token once the tokens ranked above it already reach top_p; the first always stays.
        ranked = ranked.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, ranked)

