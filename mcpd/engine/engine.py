"""The engine: one model, one device pool, one paged KV cache, and step() to advance all requests.

A step schedules a batch (batch_scheduler), runs every scheduled token of every sequence through
the model as one flat batch, samples a token for each sequence whose pending tokens are all in
the cache now, and turns the new tokens into text. The worker process owns the loop; the engine
is synchronous and single-threaded, and never raises for a request once it was accepted.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial

import msgspec
import torch

from mcpd.config import Config
from mcpd.cpu import threads
from mcpd.engine.active_tenants import ActiveTenants
from mcpd.engine.batch_scheduler import BatchScheduler
from mcpd.engine.decode_graphs import DecodeGraphs
from mcpd.engine.detokenizer import Detokenizer
from mcpd.engine.host_kv import HostKV
from mcpd.cpu.idle_cores import IdleCores
from mcpd.engine.kv_cache import KVCache
from mcpd.engine.kv_records import kv_region, region_key
from mcpd.engine.resident_weights import ResidentWeights
from mcpd.cpu.run_delay import RunDelay
from mcpd.engine.sampler import Sampler
from mcpd.engine.sequence import Sequence
from mcpd.cpu.thread_tuner import ThreadTuner
from mcpd.engine.weight_pages import onto_huge_pages
from mcpd.histogram import BATCH_BOUNDS, Histogram
from mcpd.memory import DevicePool, pool_size
from mcpd.memory.pool_segment import PoolSegment
from mcpd.memory.pool_stats import WorkerPoolStats
from mcpd.models import load_model
from mcpd.models.decode_arrays import DecodeArrays
from mcpd.models.layers import AttentionMetadata, bind_kv_cache, long_tensor
from mcpd.protocol.sampling import SamplingParams


@dataclass
class StepOutput:
    """What one sequence produced in one step."""
    key: Hashable
    token_ids: list[int]        # new tokens this step
    text: str                   # new text: only complete UTF-8, withheld while a stop string may be forming
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None   # "stop" (eos/stop token/stop string), "length", "abort"
    prompt_tokens: int
    completion_tokens: int


BUDDY_MIN_BYTES = 4096
PROCESS_THREADS = torch.get_num_threads()   # as the worker set them up (OMP_NUM_THREADS), before any tuning


def kv_share_bytes(pool_bytes: int, kv_fraction: float) -> int:
    """The KV cache's bytes of a worker's pool share: exactly kv_fraction of it, whatever its
    size; at least a page stays with the buddy for everything else."""
    return min(int(pool_bytes * kv_fraction), pool_bytes - BUDDY_MIN_BYTES)


class Engine:
    def __init__(self, config: Config, device: torch.device, host: HostKV | None = None,
                 shared_pool: PoolSegment | None = None, owner: int = 0) -> None:
        """host: the host shared-memory tier for KV blocks (the worker passes it; None: none).
        shared_pool: the device's pool (pool keeper), where the KV cache takes owner's region,
        which outlives this process; None: a private pool of this engine's own."""
        self.device = torch.device(device)
        # The weights' region first: a pool that cannot hold the model refuses before the KV is sized.
        self.resident = ResidentWeights(shared_pool, owner, config.model) if shared_pool is not None else None
        loaded = load_model(config.model, self.device, config.engine.kernels, self.resident)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.model_name, self.dtype, self.vocab_size = loaded.name, loaded.dtype, loaded.vocab_size
        self.quantization = config.model.quantization
        self.max_model_len, self.kernels_reason = loaded.max_model_len, loaded.kernels_reason
        self.pages_reason = onto_huge_pages(self.model, config.engine.huge_pages, shared_pool is not None)
        pool_bytes = pool_size.resolve_bytes(config.engine.pool_bytes, self.device)
        kv_bytes = kv_share_bytes(pool_bytes, config.engine.kv_fraction)
        layout = (config.engine.kv_block_size, self.model.num_layers, self.model.num_kv_heads, self.model.head_dim,
                  self.dtype)
        self.shared_pool = shared_pool
        if shared_pool is None:
            self.pool = DevicePool(pool_bytes, self.device, reserved_bytes=kv_bytes)
            region, records = self.pool.reserved_view((kv_bytes,), torch.uint8), None
        else:
            num_blocks = kv_bytes // KVCache.block_bytes(*layout)
            key = region_key(config.model, loaded.name, (*layout, num_blocks))
            region, records = kv_region(shared_pool, owner, key, num_blocks, KVCache.block_bytes(*layout))
        self.kv = KVCache(region, *layout, host, records)
        bind_kv_cache(self.model, self.kv.tensor)
        self.scheduler = BatchScheduler(config.engine, self.kv)
        self.sampler = Sampler(self.device, self.model.kernels.argmax)
        self.decode_arrays = DecodeArrays()
        # Only with attention that reads the paged cache in place: the graphs' tables are as wide
        # as max_model_len, and torch's attention would copy all of it every step.
        self.decode_graphs = (DecodeGraphs(self.model, self.kv, config.engine.max_num_seqs, self.max_model_len,
                                           self.device, config.engine.decode_kernel)
                              if config.engine.cuda_graphs and self.model.kernels.name == "cuda" else None)
        # 1 where the model cannot run greedy steps natively; asked once: its weights are placed by now
        self.decode_burst = config.engine.decode_burst if getattr(self.model, "runs_greedy_steps", False) else 1
        # From the process's own count, not the current one, which an earlier engine's tuner may have set.
        torch.set_num_threads(PROCESS_THREADS)
        self.thread_tuner = (self._thread_tuner()
                             if self.device.type == "cpu" and config.workers.adaptive_threads and PROCESS_THREADS > 1
                             else None)
        self.sequences: dict[Hashable, Sequence] = {}
        # A GPU's step takes about as long for one sequence as for a full batch: bounding it would
        # cost the batch its throughput and shorten nobody's wait.
        self.shared_step_decodes = config.engine.shared_step_decodes if self.device.type == "cpu" else 0
        self.tenants = ActiveTenants()   # by cache namespace: one per tenant of this model version
        self.thread_limit = PROCESS_THREADS   # threads the steps may use now (_share_cores)
        self.write_through: set[Hashable] = set()   # keys of context turns: their KV goes to the host tier
        self.aborted: list[StepOutput] = []  # reported by the next step()
        self.arrivals = itertools.count()
        self.steps = self.tokens_prefilled = self.tokens_generated = 0
        self.last_step_end = 0.0   # perf_counter: the thread tuner resets after a pause
        self.last_step_s = 0.0     # the last step's model and sampling time
        self.batch_sizes = Histogram(BATCH_BOUNDS)   # sequences per step, for the metrics endpoint
        self.last_batch: list[tuple[Sequence, int]] = []   # the last step's (sequence, tokens run): for tracing

    @staticmethod
    def _thread_tuner() -> ThreadTuner:
        """The tuner of this thread's OpenMP team: the thread that builds the engine runs its steps."""
        run_delay = RunDelay.of_team(PROCESS_THREADS)
        return ThreadTuner(PROCESS_THREADS, partial(threads.set_count, most=PROCESS_THREADS),
                           run_delay.share if run_delay is not None else None,
                           IdleCores.of(threads.owned_cores()))

    def add_request(self, key: Hashable, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_namespace: str = "", write_through: bool = False) -> None:
        """Queue a request; a higher priority is scheduled first and preempted last. It reuses the
        cached KV of earlier requests in the same cache_namespace (pass the tenant: namespaces
        never share) that began with the same tokens. write_through: when it finishes, save its
        KV blocks to the host tier (a context turn, whose next turn may run on another worker).
        Raises ValueError, naming the limit, for a request that could never run."""
        if key in self.sequences:
            raise ValueError(f"request {key!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds max_model_len {self.max_model_len}")
        # The last sampled token is never run through the model, so it needs no KV slot.
        if self.kv.blocks_for(total - 1) > self.kv.usable_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                             f"({self.kv.usable_blocks * self.kv.block_size} tokens): raise engine.pool_bytes")
        detokenizer = Detokenizer(self.tokenizer, prompt_token_ids, params.stop)
        seq = Sequence(key, prompt_token_ids, params, priority, next(self.arrivals), detokenizer,
                       cache_namespace)
        self.sequences[key] = seq
        self.tenants.arrived(cache_namespace)
        if write_through:
            self.write_through.add(key)
        self.scheduler.add(seq)

    def abort(self, key: Hashable) -> bool:
        """Drop a request and free its KV blocks now; its final output comes with the next step()."""
        seq = self.sequences.pop(key, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        self.tenants.left(seq.cache_namespace)
        self.write_through.discard(key)
        self.aborted.append(StepOutput(key, [], "", [] if seq.params.logprobs else None, True, "abort",
                                       seq.num_prompt_tokens, seq.num_completion_tokens))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.sequences or self.aborted)

    @property
    def admits_only(self) -> bool:
        """The next step would only admit waiting prompts: nothing runs, no abort waits to be reported."""
        return not self.scheduler.running and not self.aborted

    def step(self) -> list[StepOutput]:
        """One step of every scheduled sequence, in inference mode: entered here unless the caller
        already is. The worker enters it once for its loop: entering it each step is cold torch
        code after the step's weight stream, a measurable part of a batch-1 decode step's Python."""
        if torch.is_inference_mode_enabled():
            return self._step()
        with torch.inference_mode():
            return self._step()

    def _step(self) -> list[StepOutput]:
        outputs, self.aborted = self.aborted, []
        most_decodes = self.most_decodes()
        self._share_cores(most_decodes > 0)
        batch = self.last_batch = self.scheduler.schedule(most_decodes)
        if not batch:
            return outputs
        self.steps += 1
        self.batch_sizes.observe(len(batch))
        started = time.perf_counter()
        if self.thread_tuner is not None:
            self.thread_tuner.resume(started - self.last_step_end)
        burst = self._burst_length(batch)
        if burst:
            return outputs + [self._run_burst(batch[0][0], burst, started)]
        sampling, logits = self._run_model(batch)
        self.kv.step_ran()
        self.last_step_end = time.perf_counter()
        if self.thread_tuner is not None:
            self.thread_tuner.observe(sum(count for _, count in batch), self.last_step_end - started)
        tokens, logprobs = self.sampler(logits, sampling) if sampling else ([], None)
        self.last_step_s = time.perf_counter() - started
        for i, (seq, token) in enumerate(zip(sampling, tokens)):
            outputs.append(self._append(seq, token, logprobs[i] if seq.params.logprobs else None))
        return outputs

    def most_decodes(self) -> int:
        """How many sequences the next step may decode (0: all). While several tenants are active,
        a CPU step of one tenant's full batch (many times a one-token step's work) would make
        another's one-token request wait for it and then share it; steps of
        engine.shared_step_decodes keep both short, the batch's sequences taking turns."""
        return self.shared_step_decodes if self.shared_step_decodes and self.tenants.several() else 0

    def _share_cores(self, shared: bool) -> None:
        """While tenants share this CPU worker (its steps bounded), its team leaves one of its
        cores to the daemon's other processes: the front-end and the scheduler carry the other
        tenant's short requests, and behind a team on every core each of their hops would wait for one.
        A lone tenant's steps run on every thread again."""
        limit = PROCESS_THREADS - 1 if shared else PROCESS_THREADS
        if limit == self.thread_limit or limit < 1:
            return
        self.thread_limit = limit
        if self.thread_tuner is not None:
            self.thread_tuner.cap(limit)
        else:
            threads.set_count(limit, most=PROCESS_THREADS)

    def _burst_length(self, batch: list[tuple[Sequence, int]]) -> int:
        """How many greedy steps this step runs at once in native code (0: none, the step runs the
        usual way). A step's Python is a large share of a small model's step, and a lone
        sequence's next step cannot start before it: engine.decode_burst steps at a time take it
        out of all but one. A lone prompt token (a 1-token prompt, or the one its cached
        prefix leaves) runs as one such step: the same kernels, without the step's Python around
        them, and its first token goes out before any other is chosen. Only for one greedy
        sequence with nobody waiting (a burst holds a newcomer back by its length), no logprobs
        (they are Python's), and over no more slots than its blocks and the free ones give. A
        burst runs on across block ends: the blocks it fills are cached as their tokens come
        out (KVCache.filled), so a burst that stopped at each block's last slot would cost that
        slot a step of its own. Not while the thread tuner measures (ThreadTuner.measuring)."""
        if (self.decode_burst < 2 or len(batch) != 1 or self.scheduler.waiting
                or (self.thread_tuner is not None and self.thread_tuner.measuring)):
            return 0
        seq, count = batch[0]
        params = seq.params
        if count != 1 or seq.num_pending != 1 or not params.greedy or params.logprobs:
            return 0
        if not seq.num_completion_tokens:
            return 1
        room = (len(seq.block_table) + self.kv.num_free) * self.kv.block_size - seq.num_computed
        return min(self.decode_burst, params.max_tokens - seq.num_completion_tokens, room)

    def _run_burst(self, seq: Sequence, steps: int, started: float) -> StepOutput:
        """Up to `steps` greedy tokens of seq from one native call, appended as that many steps
        would append them (ending where one finishes it), reported as one output."""
        params = seq.params
        if not seq.num_completion_tokens:   # the lone prompt token this call computes
            self.tokens_prefilled += 1
        stops = params.stop_token_ids + (() if params.ignore_eos else tuple(self.tokenizer.eos_token_ids))
        self.kv.hold(seq, seq.num_computed + steps)
        tokens = self.model.greedy_steps(seq.token_ids[-1], seq.num_computed, seq.block_table, steps, stops)
        self.kv.step_ran()
        self.last_step_end = time.perf_counter()
        self.last_step_s = self.last_step_end - started
        if self.thread_tuner is not None:
            self.thread_tuner.skip(len(tokens))
        outputs = []
        for token in tokens:
            seq.num_computed += 1
            if seq.num_computed % self.kv.block_size == 0:   # before _append, which may release seq
                self.kv.filled(seq)
            outputs.append(self._append(seq, token, None))
            if outputs[-1].finished:
                break
        if len(outputs) == 1:
            return outputs[0]
        return dataclasses.replace(outputs[-1], token_ids=[t for out in outputs for t in out.token_ids],
                                   text="".join(out.text for out in outputs))

    def _run_model(self, batch: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Compute every scheduled token; return the sequences that now sample, with their logits."""
        input_ids, sample_rows, sampling = [], [], []
        for seq, count in batch:
            is_decode = count == seq.num_pending == 1 and seq.num_completion_tokens > 0
            self.tokens_prefilled += 0 if is_decode else count
            input_ids += seq.token_ids[seq.num_computed:seq.num_computed + count]
            if count == seq.num_pending:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        graphs = self.decode_graphs
        if graphs is not None and len(sample_rows) == len(input_ids) == len(batch) <= graphs.max_batch:
            return sampling, self._run_graph(batch, input_ids)   # one token each, every one sampling
        ids, attn = self._inputs(batch, input_ids)
        # Only the rows that sample go on to the logits (every row, in order, in a decode step).
        rows = (None if len(sample_rows) == len(input_ids)
                else torch.tensor(sample_rows, dtype=torch.long, device=self.device))
        # forward, not the module's __call__: its hook and mode checks, never used here, run
        # cold after a step's weight stream, a cost a batch-1 step pays in full.
        hidden = self.model.forward(ids, attn.positions, attn, rows)
        for seq, count in batch:
            seq.num_computed += count
        return sampling, self.model.compute_logits(hidden)

    def _run_graph(self, batch: list[tuple[Sequence, int]], input_ids: list[int]) -> torch.Tensor:
        """The logits of a step of single tokens, from a CUDA graph's replay (decode_graphs.py)."""
        logits = self.decode_graphs.run(input_ids, [s.block_table for s, _ in batch],
                                        [s.num_computed for s, _ in batch])
        for seq, _ in batch:
            seq.num_computed += 1
        return logits

    def _inputs(self, batch: list[tuple[Sequence, int]],
                input_ids: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's token ids as a tensor and its attention metadata; a CPU step of decodes
        (one token each) writes them into decode_arrays' kept buffer instead of new tensors."""
        tables, starts = [s.block_table for s, _ in batch], [s.num_computed for s, _ in batch]
        if self.device.type == "cpu" and len(input_ids) == len(batch):
            return self.decode_arrays.build(input_ids, tables, starts, self.kv.block_size)
        attn = AttentionMetadata.build(tables, starts, [count for _, count in batch], self.kv.block_size, self.device)
        return long_tensor(input_ids, self.device), attn

    def _append(self, seq: Sequence, token: int, logprob: float | None) -> StepOutput:
        seq.token_ids.append(token)
        self.tokens_generated += 1
        reason = self._finish_reason(seq, token)
        finished = reason is not None
        text = seq.detokenizer.take(final=finished)
        if finished:
            if seq.key in self.write_through:
                self.write_through.remove(seq.key)
                self.kv.write_through(seq)
            self.scheduler.finish(seq)
            self.tenants.left(seq.cache_namespace)
            del self.sequences[seq.key]
        return StepOutput(seq.key, [token], text, None if logprob is None else [logprob], finished, reason,
                          seq.num_prompt_tokens, seq.num_completion_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        # An end or stop token ends the request but is not text: it is never detokenized.
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids):
            return "stop"
        seq.detokenizer.add(token)
        if seq.detokenizer.stopped:
            return "stop"
        return "length" if seq.num_completion_tokens >= params.max_tokens else None

    def stats(self) -> dict:
        """Counters and gauges, plain JSON. kv_blocks_used are blocks held by live sequences;
        cached_blocks are idle blocks kept for prefix reuse, which allocation reclaims (LRU) when
        needed, so they are free capacity, not waste: kv_waste_frac counts the unused slots of held
        blocks only. prefix_cache_hits of prefix_cache_queries tokens were served from the cache
        (both count each admission, so a preempted sequence's recompute counts again)."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.preemptions,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.kv.num_blocks - self.kv.num_free,
            "kv_block_size": self.kv.block_size,
            "kv_waste_frac": self.kv.waste_frac(self.scheduler.running),
            "cached_blocks": len(self.kv.idle),
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            # Blocks this worker loaded from / saved to the host shared-memory tier.
            "host_kv_loaded": self.kv.host.loaded if self.kv.host else 0,
            "host_kv_saved": self.kv.host.saved if self.kv.host else 0,
            "pool": self._pool_figures(),
            "tokens_prefilled": self.tokens_prefilled,
            "tokens_generated": self.tokens_generated,
            "steps": self.steps,
            "batch_size": self.batch_sizes.snapshot(),
            "device": str(self.device),
            "model": self.model_name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization,   # "none" or "int8": the linear layers' weights
            "kernels": self.model.kernels.name,
            "threads": torch.get_num_threads(),
            "max_model_len": self.max_model_len,
        }

    def _pool_figures(self) -> WorkerPoolStats:
        if self.shared_pool is not None:   # the device's pool, every worker's regions counted
            figures = msgspec.structs.asdict(self.shared_pool.stats())
            del figures["regions"]   # the keeper reports them, once per device
            return WorkerPoolStats(**figures, shared=True, kv_region_bytes=self.kv.tensor.nbytes,
                                   kv_blocks_adopted=self.kv.adopted, weights_from_pool=self.resident.from_pool)
        # The whole private pool: the KV cache's reserved region counts as in use (and requested).
        pool = self.pool.stats()
        return WorkerPoolStats(**{**dataclasses.asdict(pool), "total_bytes": self.pool.nbytes,
                                  "in_use_bytes": pool.in_use_bytes + self.pool.reserved_bytes,
                                  "requested_bytes": pool.requested_bytes + self.pool.reserved_bytes},
                               shared=False, kv_reserved_bytes=self.pool.reserved_bytes,
                               internal_waste_frac=pool.internal_waste_frac,
                               external_fragmentation=pool.external_fragmentation)
