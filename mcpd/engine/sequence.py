"""One request inside the engine: its tokens, how many of them are in the KV cache, its blocks."""
from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass

from mcpd.engine.detokenizer import Detokenizer

SEED_MIN, SEED_END = -(1 << 63), 1 << 64   # what msgpack carries: int64 and uint64


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Every field is checked here, so that whatever is accepted runs:
    Engine.step() never fails on a request's parameters."""
    max_tokens: int = 16
    temperature: float = 1.0      # 0 = greedy; a positive one too small to matter acts as its limit
    top_k: int = 0                # 0 = off; larger than the vocabulary = off
    top_p: float = 1.0
    seed: int | None = None       # same seed + same prompt -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False        # logprob of each chosen token

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} = {getattr(self, name)!r}: must be an integer")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens}: must be >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature = {self.temperature!r}: must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p!r}: must be in (0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed < SEED_END):
            raise ValueError(f"seed = {self.seed!r}: must be an integer in [-2**63, 2**64)")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be integers")

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
