"""A model's figures as the scheduler reports them (Scheduler.models_stats) and a handler's
signature as its worker declares it in its Hello: declared apart from messages.py and
child_stats.py so that both read them without loading each other."""
from __future__ import annotations

import msgspec

from mcpd.daemon.frontend.latency import LatencySummary
from mcpd.histogram import Snapshot


class TensorMetadata(msgspec.Struct, frozen=True):
    """A handler's declared input or output (handlers/tensors.py's TensorSpec); a map, as the
    status and the KServe metadata show it."""
    datatype: str
    shape: list[int]   # -1: any


class Signature(msgspec.Struct, frozen=True):
    inputs: dict[str, TensorMetadata]
    outputs: dict[str, TensorMetadata]


class ShadowStats(msgspec.Struct, frozen=True):
    """A model's shadow pairs (shadow.py's Agreement): started, shed, compared and identical, how
    far apart the others' tokens and logprobs were (None: none to average), each side's latency."""
    candidate: str | None
    fraction: float
    started: int
    shed: int
    compared: int
    identical: int
    agreement: float | None
    mean_first_divergence: float | None
    mean_logprob_diff: float | None
    primary_latency: Snapshot
    shadow_latency: Snapshot


class VersionStats(msgspec.Struct, frozen=True, kw_only=True):
    """A model version: loaded, requests routed to it (traffic.py); its ready workers, requests
    waiting, running and answered, its answers' recent latency (None: none yet), its kind and a
    handler's signature (None: a language model, or no worker has said it yet)."""
    loaded: bool
    routed: int
    workers: list[int] = []
    queued: int = 0
    running: int = 0
    answered: int = 0
    latency: LatencySummary | None = None
    kind: str = ""
    signature: Signature | None = None


class ModelStats(msgspec.Struct, frozen=True, kw_only=True):
    """A model's traffic policy (its primary and split), whether rollback has somewhere to go, its
    fast version (None: none) and the requests sent there, its versions, its shadow (None: off)."""
    primary: str
    split: dict[str, float]
    can_roll_back: bool
    fast: str | None
    routed_fast: int
    versions: dict[str, VersionStats]
    shadow: ShadowStats | None = None


class ModelsStats(msgspec.Struct, frozen=True):
    default_model: str | None = None
    models: dict[str, ModelStats] = {}
