"""Which sequences run in the next step, and how many of their tokens (continuous batching).

Each step, under a budget of max_step_tokens:
1. Running sequences, decodes (one token each) before prefill chunks, most important first
   (higher priority, then older). Every decoding sequence advances by one token per step.
2. Waiting sequences are admitted in order while the budget, a seat (max_num_seqs) and free KV
   blocks allow. A waiting sequence more important than the least important running one takes
   that one's seat and blocks when it lacks either (preempted as in 3), so an urgent request
   never waits behind a full batch of less important ones. A sequence shares the cached blocks of its longest cached prefix (kv_cache), copies
   the cached rows of the tokens after them, and computes only the rest; a remainder longer than the budget is prefilled in chunks over steps.
3. A running sequence that needs a block when none is free preempts the least important running
   sequence (lowest priority, then newest), possibly itself: it lets go of its blocks and waits to
   recompute prompt + generated tokens (its full blocks stay cached while nobody needs the room,
   so the recompute may be short). Requests are delayed, never failed. A step that preempted
   admits only sequences more important than every victim, so no victim is re-admitted into the
   blocks it just gave up, and equals never preempt each other back and forth.
4. A step may decode at most `most_decodes` running sequences (while tenants share the engine, so
   that a newcomer waits for a short step, not for a whole batch): the most important, then those
   longest without a turn, so they all take turns. Prefill chunks and admissions are not bounded.
   While they are bounded, waiting sequences of tenants with nothing running are admitted in a
   step of their own: a newcomer's first token costs its prefill, not that plus others' decodes.
Every sequence fits the whole cache on its own (Engine.add_request checks), so the most important
sequence always makes progress and preemption cannot loop forever.
"""
from __future__ import annotations

import bisect
import math

from mcpd.config import EngineConfig
from mcpd.engine.kv_cache import KVCache
from mcpd.engine.sequence import Sequence, Status


class BatchScheduler:
    def __init__(self, config: EngineConfig, kv: KVCache) -> None:
        self.kv = kv
        self.max_num_seqs = config.max_num_seqs
        self.max_step_tokens = config.max_step_tokens
        self.waiting: list[Sequence] = []  # both lists sorted by Sequence.order
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.turns = 0   # sequences scheduled so far, each one's place in the order bounded steps take turns in

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def finish(self, seq: Sequence) -> None:
        """Drop seq, finished or aborted, and free its blocks at once."""
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.kv.release(seq)
        seq.status = Status.FINISHED

    def schedule(self, most_decodes: int = 0) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) pairs, decodes first. Blocks for them are reserved.
        most_decodes: at most this many sequences decode in the step (0: every one)."""
        batch: dict[Sequence, int] = {}
        if most_decodes and self._admit_newcomer(batch):
            return list(batch.items())
        budget = self.max_step_tokens
        decodes_left = most_decodes or len(self.running)
        floor = -math.inf   # the highest priority preempted this step: only those above it are admitted
        for seq in sorted(self.running, key=self._turns if most_decodes else self._decodes_first):
            decode = seq.num_pending == 1
            if seq.status is not Status.RUNNING or budget == 0 or (decode and decodes_left == 0):
                continue  # preempted by a sequence before it, or no budget left for its chunk or decode
            count = min(seq.num_pending, budget)
            while not self.kv.can_grow(seq, seq.num_computed + count):
                victim = self.running[-1]
                budget += self._preempt_in_step(victim, batch)
                floor = max(floor, victim.priority)
                if victim is seq:
                    break
            else:
                self.kv.grow(seq, seq.num_computed + count)
                batch[seq] = count
                budget -= count
                decodes_left -= decode
                self._took_turn(seq)
        self._admit(batch, budget, floor)
        return list(batch.items())

    def _took_turn(self, seq: Sequence) -> None:
        self.turns += 1
        seq.last_turn = self.turns

    @staticmethod
    def _decodes_first(seq: Sequence) -> bool:
        return seq.num_pending > 1   # a stable sort: the running order within each

    @staticmethod
    def _turns(seq: Sequence) -> tuple[int, bool, int]:
        return -seq.priority, seq.num_pending > 1, seq.last_turn

    def _admit(self, batch: dict[Sequence, int], budget: int, floor: float) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.priority <= floor:
                return
            if count := self._seat(seq, batch, budget):
                budget -= count
                continue
            victim = self.running[-1] if self.running else None
            if victim is None or victim.priority >= seq.priority:
                return   # it waits for a seat or blocks like everyone else
            budget += self._preempt_in_step(victim, batch)
            floor = max(floor, victim.priority)

    def _admit_newcomer(self, batch: dict[Sequence, int]) -> bool:
        """Admit the first waiting sequences, in order, while each one's tenant has nothing running
        and a seat and blocks are free for it (never by preempting: a step of their own must not
        cost the others more). Whether any was admitted."""
        budget = self.max_step_tokens
        while self.waiting and budget > 0:
            namespace = self.waiting[0].cache_namespace
            if any(other.cache_namespace == namespace for other in self.running):
                break
            if not (count := self._seat(self.waiting[0], batch, budget)):
                break
            budget -= count
        return bool(batch)

    def _seat(self, seq: Sequence, batch: dict[Sequence, int], budget: int) -> int:
        """Move the first waiting sequence, seq, to running with its first chunk in the batch if a
        seat and blocks are free; returns the chunk's tokens (0: not admitted)."""
        cached = self.kv.lookup(seq)
        count = min(len(seq.token_ids) - cached.num_tokens, budget)
        if len(self.running) >= self.max_num_seqs or not self.kv.can_admit(cached, count):
            return 0
        del self.waiting[0]
        self.kv.admit(seq, cached, count)
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.order)
        batch[seq] = count
        self._took_turn(seq)
        return count

    def _preempt_in_step(self, victim: Sequence, batch: dict[Sequence, int]) -> int:
        """Preempt victim, taking it out of this step's batch; returns the budget it gives back."""
        returned = batch.pop(victim, 0)
        start = victim.num_computed
        shared_pending = self._preempt(victim)
        return returned - self._hand_over(shared_pending, victim, start, batch)

    def _hand_over(self, blocks: list[int], victim: Sequence, start: int, batch: dict[Sequence, int]) -> int:
        """Blocks the victim was to compute in this step (from token `start` on) are shared by
        sequences admitted after it in this step, which took them as cached: the first sharer of
        each now computes it, going back to where the victim stood. Returns the tokens added to
        the batch, at most what the victim's chunk held (each block is taken over once)."""
        orphans = set(blocks)
        added = 0
        for seq in batch:
            shared = seq.block_table[:self.kv.blocks_for(seq.num_computed)]
            first = next((i for i, b in enumerate(shared) if b in orphans and self.kv.pending[b] is victim), None)
            if first is None:
                continue
            resume = max(first * self.kv.block_size, start)
            for block in shared[first:]:
                if block in orphans and self.kv.pending[block] is victim:
                    self.kv.hand_over(block, seq)
            extra = seq.num_computed - resume
            seq.num_computed = resume
            self.kv.prefix_cache_hits -= extra
            batch[seq] += extra
            added += extra
        return added

    def _preempt(self, seq: Sequence) -> list[int]:
        self.running.remove(seq)
        shared_pending = self.kv.release(seq)
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)
        self.preemptions += 1
        return shared_pending
