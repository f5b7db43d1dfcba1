"""Decode steps on a CUDA device as replays of CUDA graphs, one graph per bucket of batch sizes.

Why: run eagerly, a decode step launches each op of each layer from Python, ~10 a layer, and on a
GPU an op of a small model or a small batch takes a few microseconds where its launch takes tens,
so launches, not the weights' read, bound the step. A graph launches the whole step (embedding to logits) at once.

A graph replays fixed shapes at fixed addresses, so a step is written into static buffers:
- the batch is padded up to its bucket (1, 2, 4, 8, then every 8 up to engine.max_num_seqs); a
  padding row computes token 0 at position 0, writes its key and value into a block reserved for
  that (KVCache.reserve) and attends to that one slot; its logits are dropped;
- block tables are as wide as max_model_len needs, so no sequence outgrows them; the attention
  reads only each sequence's context_lens tokens (cuda_kernels.py), whatever the width;
- the rope table is grown to max_model_len before the first capture: forward never replaces it.
The step's arrays go into one pinned host buffer, then to the device buffer the graphs read by
one asynchronous copy queued before the replay on the same stream. The next step overwrites the
host buffer only after the sampler has waited for this step's tokens, so after the copy.

Batches of up to 8 may run as one persistent kernel instead (kernels/cuda_decode_step.py,
engine.decode_kernel): with "auto" both are captured when the bucket is first used, timed over a
few replays of the very step, and the faster kept.

Graphs are captured when a bucket is first used (a worker that never runs 48 sequences holds no
graph for 48), after one eager run of that step: Triton compiles and cuBLAS picks its kernels
outside the capture. The eager run computes exactly the step the replay then computes (the same
keys and values into the same slots). All graphs share one memory pool: only one runs at a time.

The CPU twin: on a CPU the same buffers, padding and tables run eagerly (no capture); the tests
hold it to the engine's ordinary steps token for token, on machines without a GPU.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from mcpd.engine.kv_cache import KVCache
from mcpd.models.layers import AttentionGroup, AttentionMetadata

log = logging.getLogger(__name__)
ROWS = 5   # per-row arrays in the buffer: token ids, positions, slot blocks, slot offsets, context lengths


def buckets(most: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 8, up to `most` (included)."""
    sizes = [size for size in (1, 2, 4) if size < most] + list(range(8, most, 8))
    return sizes + [most]


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, max_num_seqs: int, max_model_len: int, device: torch.device,
                 decode_kernel: str = "graph") -> None:
        """model: a model whose decode attention reads the paged cache in place (a whole-width
        gather per step would cost far more than a graph saves). decode_kernel: engine's."""
        self.model, self.device, self.decode_kernel = model, device, decode_kernel
        self.steps: dict = {}   # batch size -> the persistent kernel's DecodeStep, None: layer by layer
        self.sizes = buckets(max_num_seqs)
        self.block_size = kv.block_size
        self.scratch = kv.reserve()
        self.width = kv.blocks_for(max_model_len)
        most = self.sizes[-1]
        cuda = device.type == "cuda"
        self.host = torch.empty(most * (ROWS + self.width), dtype=torch.long, pin_memory=cuda)
        self.buffer = torch.empty_like(self.host, device=device) if cuda else self.host
        self.rows = self.host[:ROWS * most].view(ROWS, most).numpy()
        self.tables = self.host[ROWS * most:].view(most, self.width).numpy()
        # A padding row: token 0 at position 0, its slot the reserved block's first, attending to it alone.
        self.padding = np.array([0, 0, self.scratch, 0, 1])[:, None]
        self.rows[:] = self.padding
        self.tables[:] = self.scratch   # never a block nobody zeroed: the CPU twin's gather reads every entry
        self.num_positions = max_model_len
        if getattr(model, "rope", None) is not None:
            model.rope.table(max_model_len, kv.tensor.dtype)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda else None

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def run(self, token_ids: list[int], block_tables: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] of sequences that each compute one token, token_ids[i] at
        position starts[i], their KV in block_tables[i]; at most max_batch of them."""
        count = len(token_ids)
        size = next(size for size in self.sizes if size >= count)
        self._write(token_ids, block_tables, starts, size)
        if self.device.type != "cuda":
            return self._forward(size, self._step(size))[:count]
        self.buffer.copy_(self.host, non_blocking=True)
        graph = self.graphs.get(size)
        if graph is None:
            graph = self.graphs[size] = self._capture(size)
        graph[0].replay()
        return graph[1][:count]

    def _write(self, token_ids: list[int], block_tables: list[list[int]], starts: list[int], size: int) -> None:
        count, block_size = len(token_ids), self.block_size
        rows = self.rows
        rows[0, :count] = token_ids
        rows[1, :count] = starts
        rows[2, :count] = [table[start // block_size] for table, start in zip(block_tables, starts)]
        rows[3, :count] = [start % block_size for start in starts]
        rows[4, :count] = [start + 1 for start in starts]
        rows[:, count:size] = self.padding
        for row, table in enumerate(block_tables):
            self.tables[row, :len(table)] = table   # entries past a table's end: masked by its length
        self.tables[count:size, 0] = self.scratch

    def _views(self, size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The device buffer cut for a batch of `size`: token ids and the step's metadata."""
        most = self.max_batch
        ids, positions, slot_blocks, slot_offsets, context_lens = self.buffer[:ROWS * most].view(ROWS, most)[:, :size]
        table = self.buffer[ROWS * most:].view(most, self.width)[:size]
        group = AttentionGroup(0, size, table, context_lens)
        return ids, AttentionMetadata(positions, slot_blocks, slot_offsets, [group], self.num_positions)

    def _step(self, size: int):
        """The persistent kernel's DecodeStep for a batch of `size`, where it is asked for and runs;
        else None."""
        if size not in self.steps:
            self.steps[size] = None
            if self.decode_kernel != "graph":
                from mcpd.kernels.cuda_decode_step import decode_step_for   # Triton: CUDA builds only
                self.steps[size] = decode_step_for(self.model, size)
        return self.steps[size]

    def _forward(self, size: int, step) -> torch.Tensor:
        ids, attn = self._views(size)
        if step is not None:
            return step.logits_for(ids, attn)
        return self.model.compute_logits(self.model.forward(ids, attn.positions, attn))

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket's graph; with decode_kernel auto, the faster of the persistent kernel's and
        the layer-by-layer one's over a few replays of this step (replays rewrite the same keys and
        values: the step's inputs do not change)."""
        step = self._step(size)
        if step is None:
            return self._capture_with(size, None)
        persistent = self._capture_with(size, step)
        if self.decode_kernel == "persistent":
            return persistent
        layered = self._capture_with(size, None)
        times = _replay_ms(persistent[0]), _replay_ms(layered[0])
        kept = "persistent" if times[0] <= times[1] else "graph"
        log.info("decode steps of %d sequences: %s (one kernel %.3f ms, layer by layer %.3f ms)", size, kept, *times)
        if kept == "graph":
            self.steps[size] = None
            return layered
        return persistent

    def _capture_with(self, size: int, step) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._forward(size, step)   # eager first: compiles, picks kernels; computes this very step
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size, step)
        return graph, logits


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """A graph's mean replay time, ms, after one untimed replay."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
