"""Shadow traffic: a share of a model's requests also runs on a candidate version, and the two
answers are compared. The client gets the primary's answer only; the shadow's is thrown away
once compared.

Which requests: a model's `shadow_fraction` of them, by credit (each request adds the fraction,
one with a full credit point is shadowed), so the share is exact and needs no randomness; not
context turns (a turn commits to its context: a copy must not). The shadow runs as the least
important request there is: in the lowest class, never while the degradation ladder is on or the
queue is deep, first to be displaced from a full queue, and one that is refused or fails is
counted as shed, never answered.

A pair is compared when both have answered: identical tokens (both greedy: same model, same
tokens), the first position where they differ, the mean absolute difference of the tokens'
logprobs over the common prefix (the shadow always asks for logprobs; the primary's come when
its client asked for them), and each side's latency from dispatch to answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mcpd.daemon.model_stats import ShadowStats
from mcpd.histogram import LATENCY_BOUNDS, Histogram
from mcpd.protocol.control_results import ShadowSetting
from mcpd.protocol.results import GenerateResult


@dataclass
class Pair:
    model: str
    primary: dict | None = None   # each side's answer: {"token_ids", "logprobs", "latency_s"}
    shadow: dict | None = None


@dataclass
class Agreement:
    """What the comparisons of one model's shadow pairs found."""
    candidate: str = ""
    fraction: float = 0.0
    started: int = 0
    shed: int = 0
    compared: int = 0
    identical: int = 0
    divergence_positions: int = 0   # sum of first-divergence positions of the pairs that differ
    logprob_diffs: int = 0          # pairs with logprobs on both sides
    logprob_diff_sum: float = 0.0
    primary_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS))
    shadow_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS))

    def record(self, primary: dict, shadow: dict) -> None:
        self.compared += 1
        a, b = primary["token_ids"], shadow["token_ids"]
        common = min(len(a), len(b))
        first = next((i for i in range(common) if a[i] != b[i]), common)
        if a == b:
            self.identical += 1
        else:
            self.divergence_positions += first
        if primary.get("logprobs") and shadow.get("logprobs") and first:
            self.logprob_diffs += 1
            self.logprob_diff_sum += sum(abs(x - y) for x, y in zip(primary["logprobs"][:first],
                                                                   shadow["logprobs"][:first])) / first
        self.primary_latency.observe(primary["latency_s"])
        self.shadow_latency.observe(shadow["latency_s"])

    def describe(self) -> ShadowStats:
        differ = self.compared - self.identical
        return ShadowStats(
            candidate=self.candidate or None, fraction=self.fraction, started=self.started, shed=self.shed,
            compared=self.compared, identical=self.identical,
            agreement=round(self.identical / self.compared, 6) if self.compared else None,
            mean_first_divergence=round(self.divergence_positions / differ, 3) if differ else None,
            mean_logprob_diff=round(self.logprob_diff_sum / self.logprob_diffs, 6) if self.logprob_diffs else None,
            primary_latency=self.primary_latency.snapshot(), shadow_latency=self.shadow_latency.snapshot())


class ShadowBook:
    """The shadow policy of each model and the pairs in flight, keyed by the primary's rid."""

    def __init__(self):
        self.models: dict[str, Agreement] = {}
        self.credit: dict[str, float] = {}
        self.pairs: dict[int, Pair] = {}
        self.primary_of: dict[int, int] = {}   # shadow rid -> primary rid

    def set(self, model: str, candidate: str, fraction: float) -> ShadowSetting:
        """Shadow `fraction` of `model`'s requests on `candidate` ("": off; the last candidate's
        figures stay). The figures start again when the candidate changes."""
        agreement = self.models.get(model)
        if candidate and (agreement is None or agreement.candidate != candidate):
            agreement = self.models[model] = Agreement(candidate)
        if agreement is not None:
            agreement.fraction = fraction if candidate else 0.0
        return ShadowSetting(model, candidate or None, fraction if candidate else 0.0)

    def candidate(self, model: str) -> str | None:
        """The version to shadow this request of `model` on, or None."""
        agreement = self.models.get(model)
        if agreement is None or not agreement.fraction:
            return None
        credit = self.credit.get(model, 0.0) + agreement.fraction
        self.credit[model] = credit - 1 if credit >= 1 else credit
        return agreement.candidate if credit >= 1 else None

    def start(self, model: str, primary_rid: int, shadow_rid: int) -> None:
        self.models[model].started += 1
        self.pairs[primary_rid] = Pair(model)
        self.primary_of[shadow_rid] = primary_rid

    def answered(self, rid: int, result: GenerateResult, latency_s: float) -> None:
        """A side of a pair answered well; the pair is compared once both have."""
        shadow = rid in self.primary_of
        primary_rid = self.primary_of.pop(rid) if shadow else rid
        pair = self.pairs.get(primary_rid)
        if pair is None:
            return   # its other side failed or was shed
        side = {"token_ids": result.token_ids, "logprobs": result.logprobs, "latency_s": latency_s}
        if shadow:
            pair.shadow = side
        else:
            pair.primary = side
        if pair.primary is not None and pair.shadow is not None:
            del self.pairs[primary_rid]
            self.models[pair.model].record(pair.primary, pair.shadow)

    def failed(self, rid: int) -> None:
        """A side of a pair was refused, shed or failed: nothing to compare."""
        shadow = rid in self.primary_of
        pair = self.pairs.pop(self.primary_of.pop(rid) if shadow else rid, None)
        if pair is not None and shadow:
            self.models[pair.model].shed += 1

    def describe(self) -> dict[str, ShadowStats]:
        return {model: a.describe() for model, a in self.models.items() if a.candidate}
