"""One request inside the engine: its tokens, how many of them are in the KV cache, its blocks."""
from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from mcpd.engine.detokenizer import Detokenizer


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0
    seed: int | None = None       # same seed + same prompt -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False        # logprob of each chosen token

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, key: Hashable, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int, arrival: int, detokenizer: Detokenizer, cache_namespace: str) -> None:
        self.key = key
        self.params = params
        self.priority = priority            # higher runs first and is preempted last
        self.arrival = arrival              # engine-wide counter: older sequences win ties
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed = 0               # leading tokens whose keys and values are in the KV cache
        self.block_table: list[int] = []    # KV blocks holding those tokens, in order
        self.cache_namespace = cache_namespace  # KV blocks are shared only within one namespace
        self.block_hashes: list[bytes] = []  # chained hashes of its leading full blocks, as needed
        self.status = Status.WAITING
        self.detokenizer = detokenizer

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model: the prompt at first, then the last sampled token,
        or everything again after a preemption dropped the KV."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def order(self) -> tuple[int, int]:
        """Sort key: most important first (higher priority, then older)."""
        return -self.priority, self.arrival
