"""One request inside the engine: its tokens, how many of them are in the KV cache, its blocks."""
from __future__ import annotations

import enum
from collections.abc import Hashable

from mcpd.engine.detokenizer import Detokenizer
from mcpd.protocol.sampling import SamplingParams


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
        self.last_turn = 0                  # BatchScheduler.turns when it was last scheduled
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
