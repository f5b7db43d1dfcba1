"""Which version of which model a request runs on: the model table (config/models.py's [models]) and
the traffic policies an operator changes live (`mcpctl models ...`, or a reload).

Per model there is a primary version (the table's `default`, then what `promote` names) and an
optional split: weights per version. A request that names its version gets that one; else a
split picks by weighted rendezvous hashing of the request's routing key (its tenant unless it
names one): every version scores -weight / ln(u), u a uniform draw seeded by (key, version), and
the highest wins. Weights are divided by the largest when a split is set: a weight near the float
maximum would overflow the score to inf, and infinities tie. The same key lands on the same version for the same weights, the versions'
shares follow the weights, and changing one version's weight moves only keys to or from it.

Every change applies to requests admitted from then on: a request already routed (queued or
running) stays where it is, so a switch drops nothing. `rollback` undoes the last `promote` or
`split` (a model keeps its last HISTORY policies). A version that is not loaded takes no
request, and one that traffic goes to cannot be unloaded: promote or split away from it first.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from mcpd.config import ModelEntry
from mcpd.daemon.model_stats import ModelStats, VersionStats
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.control_results import TrafficPolicy

HISTORY = 16   # policies a model remembers for rollback
SPLIT_SCALE = 2.0 ** 52


@dataclass(frozen=True)
class Policy:
    """Where a model's requests go: the primary, or by weights when a split is set."""
    primary: str
    split: tuple[tuple[str, float], ...] = ()   # (version, weight), weights > 0, as the operator gave them
    scaled: tuple[tuple[str, float], ...] = field(init=False, compare=False)   # what routing uses: the largest is 1

    def __post_init__(self):
        object.__setattr__(self, "scaled", normalised(self.split))

    def describe(self) -> dict:
        return {"primary": self.primary, "split": dict(self.split)}

    def result(self, model: str) -> TrafficPolicy:
        """The answer to the control op that set it."""
        return TrafficPolicy(model, self.primary, dict(self.split))


@dataclass
class ModelTraffic:
    versions: tuple[str, ...]        # configured, in table order
    loaded: set[str]
    policy: Policy
    configured: Policy                                     # the table's: a reload that keeps it keeps the live one
    history: list[Policy] = field(default_factory=list)   # earlier policies, the latest last
    routed: dict[str, int] = field(default_factory=dict)   # requests routed per version
    fast: str = ""                   # the version the fast rung sends requests to (fast_rung.py)
    routed_fast: int = 0

    def targets(self) -> set[str]:
        """The versions this model's traffic goes to now."""
        return {v for v, _ in self.policy.split} or {self.policy.primary}


def normalised(split: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """The weights over the largest (the same shares); a weight that underflows to 0 leaves."""
    largest = max((w for _, w in split), default=1.0)
    return tuple((v, w / largest) for v, w in split if w / largest > 0)


def unit_draw(digest: bytes) -> float:
    """A uniform draw in (0, 1) from 8 digest bytes: their top 52 bits and a half, exact in a float, never 0
    nor 1 (all 64 could round up to 1, and ln 1 = 0 divides)."""
    return ((int.from_bytes(digest, "big") >> 12) + 0.5) / SPLIT_SCALE


def split_choice(key: str, model: str, split: tuple[tuple[str, float], ...]) -> str:
    """The version weighted rendezvous hashing gives `key` (see the module's comment); `split`'s
    weights at most 1 (normalised), so -weight / ln(u) cannot overflow."""
    def score(version: str, weight: float) -> float:
        digest = hashlib.blake2b(f"{model}\0{version}\0{key}".encode(), digest_size=8).digest()
        return -weight / math.log(unit_draw(digest))
    return max(split, key=lambda vw: (score(*vw), vw[0]))[0]


class Traffic:
    def __init__(self, table: dict[str, ModelEntry], default_model: str):
        self.models: dict[str, ModelTraffic] = {}
        self.configure(table, default_model)

    def configure(self, table: dict[str, ModelEntry], default_model: str) -> list[str]:
        """Take the table's policies (at start, or a reload): a model whose entry is new or
        changed gets its default and split from the table; the others keep their live policy.
        Returns the models whose policy was set."""
        self.default_model = default_model
        changed = []
        for name, entry in table.items():
            policy = Policy(entry.default_version, tuple(sorted((v, float(w)) for v, w in entry.split.items() if w > 0)))
            loaded = {v for v, cfg in entry.versions.items() if cfg.loaded}
            known = self.models.get(name)
            if known is not None and known.versions == tuple(entry.versions) and known.configured == policy:
                known.fast = entry.fast
                continue   # as configured before: the live policy (promoted, say) stands
            self.models[name] = ModelTraffic(tuple(entry.versions), loaded if known is None else known.loaded,
                                             policy, policy, [policy], fast=entry.fast)
            changed.append(name)
        return changed

    # -- routing --------------------------------------------------------------------------------

    def route(self, model: str | None, version: str | None, key: str, fast: bool = False) -> tuple[str, str]:
        """(model, version) of a request that names `model` and `version` (None: the default
        model; its policy's version, or its fast version when `fast` and it has a loaded one).
        UNKNOWN_MODEL for a model or version not served now."""
        name = model or self.default_model
        traffic = self.check_model(name)
        if version is None and fast and traffic.fast in traffic.loaded:
            version = traffic.fast
            traffic.routed_fast += 1
        elif version is None:
            version = split_choice(key, name, traffic.policy.scaled) if traffic.policy.split else traffic.policy.primary
        elif version not in traffic.versions:
            raise MCPDError(codes.UNKNOWN_MODEL, f"model {name!r} has no version {version!r}; it has "
                                                 f"{', '.join(traffic.versions)}")
        elif version not in traffic.loaded:
            raise MCPDError(codes.UNKNOWN_MODEL, f"version {version!r} of model {name!r} is not loaded "
                                                 f"(`mcpctl models load {name} {version}`)")
        traffic.routed[version] = traffic.routed.get(version, 0) + 1
        return name, version

    # -- policies, changed live -----------------------------------------------------------------

    def promote(self, model: str, version: str) -> TrafficPolicy:
        """Every new request of `model` to `version` (a split ends)."""
        traffic = self.check_loaded(model, version)
        return self._set(model, traffic, Policy(version))

    def split(self, model: str, weights: dict[str, float]) -> TrafficPolicy:
        """New requests of `model` spread over versions by weight (the primary stays as it was:
        a split that ends by rollback goes back to it)."""
        traffic = self.check_model(model)
        for version, weight in weights.items():
            self.check_loaded(model, version)
            if not (math.isfinite(weight) and weight >= 0):
                raise MCPDError(codes.BAD_REQUEST, f"split: the weight of {version!r} must be a finite number >= 0")
        chosen = tuple(sorted((v, float(w)) for v, w in weights.items() if w > 0))
        if not chosen:
            raise MCPDError(codes.BAD_REQUEST, "split: at least one version needs a weight > 0")
        return self._set(model, traffic, Policy(traffic.policy.primary, chosen))

    def rollback(self, model: str) -> TrafficPolicy:
        """Back to the policy before the last promote or split."""
        traffic = self.check_model(model)
        if len(traffic.history) < 2:
            raise MCPDError(codes.CONFLICT, f"model {model!r}: nothing to roll back to")
        traffic.history.pop()
        earlier = traffic.history[-1]
        missing = {v for v in ({v for v, _ in earlier.split} or {earlier.primary}) if v not in traffic.loaded}
        if missing:
            traffic.history.append(traffic.policy)
            raise MCPDError(codes.CONFLICT, f"model {model!r}: the earlier policy sends traffic to "
                                            f"{', '.join(sorted(missing))}, which is not loaded; load it first")
        traffic.policy = earlier
        return earlier.result(model)

    def _set(self, model: str, traffic: ModelTraffic, policy: Policy) -> TrafficPolicy:
        traffic.policy = policy
        traffic.history = [*traffic.history, policy][-HISTORY:]
        return policy.result(model)

    def load(self, model: str, version: str) -> None:
        self._version(model, version)
        self.models[model].loaded.add(version)

    def check_unload(self, model: str, version: str) -> None:
        """CONFLICT while traffic goes to the version: it would have nowhere to go."""
        traffic = self._version(model, version)
        if version in traffic.targets() or version == traffic.fast:
            raise MCPDError(codes.CONFLICT, f"version {version!r} of model {model!r} takes traffic "
                                            f"({traffic.policy.describe()}): promote or split away from it first")

    def unload(self, model: str, version: str) -> None:
        self.check_unload(model, version)
        self.models[model].loaded.discard(version)

    # -- lookups --------------------------------------------------------------------------------

    def check_model(self, model: str) -> ModelTraffic:
        traffic = self.models.get(model)
        if traffic is None:
            raise MCPDError(codes.UNKNOWN_MODEL, f"no model {model!r}; served: {', '.join(self.models)}")
        return traffic

    def _version(self, model: str, version: str) -> ModelTraffic:
        traffic = self.check_model(model)
        if version not in traffic.versions:
            raise MCPDError(codes.UNKNOWN_MODEL, f"model {model!r} has no version {version!r}; it has "
                                                 f"{', '.join(traffic.versions)}")
        return traffic

    def check_loaded(self, model: str, version: str) -> ModelTraffic:
        traffic = self._version(model, version)
        if version not in traffic.loaded:
            raise MCPDError(codes.CONFLICT, f"version {version!r} of model {model!r} is not loaded "
                                            f"(`mcpctl models load {model} {version}`)")
        return traffic

    def describe(self) -> dict[str, ModelStats]:
        """Per model: its policy, whether rollback has somewhere to go, and per version whether
        it is loaded and how many requests were routed to it."""
        return {name: ModelStats(primary=t.policy.primary, split=dict(t.policy.split), can_roll_back=len(t.history) > 1,
                                 fast=t.fast or None, routed_fast=t.routed_fast,
                                 versions={v: VersionStats(loaded=v in t.loaded, routed=t.routed.get(v, 0))
                                           for v in t.versions})
                for name, t in self.models.items()}
