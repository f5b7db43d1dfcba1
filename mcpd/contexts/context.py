"""One context: a tenant's long-lived, versioned state (token history plus named fields).

Every committed change bumps the version by one. The context remembers, per field, the version
that last changed it, so `get since v` can send only what changed after v; token ids, which
mostly grow, are sent as an append whenever they only grew since v.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mcpd.protocol import delta as codec
from mcpd.protocol.delta import DeltaLimits, FieldDelta

TOKENS = "tokens"           # reserved field: the model-visible history, 1-D int32
TOKEN_HISTORY = 1024        # versions for which token growth is remembered for `get since`
# Deltas read back from the host cache or the journal were checked against the store's limits
# when it committed them; replaying them only rebuilds what it accepted, whatever limits the
# restarted daemon was given (a journal written under a larger contexts.max_field_bytes must
# not stop a start).
REPLAY_LIMITS = DeltaLimits(max_field_bytes=1 << 62)


def value_nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (bytes, str)):
        return len(value)
    return 8


def _nbytes_of(fields: dict, name: str) -> int:
    return value_nbytes(fields[name]) if name in fields else 0


@dataclass
class Context:
    id: str
    owner: str
    version: int = 0
    fields: dict = field(default_factory=lambda: {TOKENS: np.zeros(0, np.int32)})
    changed_at: dict[str, int] = field(default_factory=dict)
    deleted_at: dict[str, int] = field(default_factory=dict)
    token_count_at: dict[int, int] = field(default_factory=lambda: {0: 0})
    tokens_rewritten_at: int = 0      # last version where tokens changed other than by growing
    busy_with: int | None = None      # rid of the generate running on it (updates wait their turn)
    worker_hint: int | None = None    # the worker that ran its last turn, and may still hold its KV
    # "model/version" whose KV its last turn left: a turn on another version does not reuse it
    # (workers namespace KV by version: daemon/worker/core.py), it recomputes.
    kv_version: str | None = None
    # Kept up to date by commit, which touches only the fields a version changed: a commit to a
    # context of many fields costs what it changes, not what the context holds.
    nbytes: int = field(init=False)
    changed_now: set[str] = field(init=False, default_factory=set)   # the fields this version changed
    deleted_now: set[str] = field(init=False, default_factory=set)   # ... and deleted

    def __post_init__(self) -> None:
        self.nbytes = sum(value_nbytes(v) for v in self.fields.values())

    @property
    def tokens(self) -> np.ndarray:
        return self.fields[TOKENS]

    def nbytes_after(self, fields: dict, touched: set[str]) -> int:
        """The context's bytes with `fields` installed, which differ from its own only in `touched`."""
        return self.nbytes + sum(_nbytes_of(fields, name) - _nbytes_of(self.fields, name) for name in touched)

    def saved(self) -> tuple:
        """What `commit` changes, to put back with `roll_back` if the commit is refused after all."""
        return (self.version, self.fields, dict(self.changed_at), dict(self.deleted_at),
                dict(self.token_count_at), self.tokens_rewritten_at, self.nbytes, self.changed_now, self.deleted_now)

    def roll_back(self, saved: tuple) -> None:
        (self.version, self.fields, self.changed_at, self.deleted_at, self.token_count_at,
         self.tokens_rewritten_at, self.nbytes, self.changed_now, self.deleted_now) = saved

    def commit(self, fields: dict, changed: set[str], deleted: set[str], nbytes: int | None = None) -> None:
        """Install a validated new state as the next version (of nbytes, when the caller knows)."""
        old_count = len(self.tokens)
        self.nbytes = self.nbytes_after(fields, changed | deleted) if nbytes is None else nbytes
        self.changed_now, self.deleted_now = changed - deleted, set(deleted)
        self.version += 1
        self.fields = fields
        for name in changed:
            self.changed_at[name] = self.version
            self.deleted_at.pop(name, None)
        for name in deleted:
            self.deleted_at[name] = self.version
            self.changed_at.pop(name, None)
        grew = len(self.tokens) >= old_count and TOKENS in changed and \
            np.array_equal(self.tokens[:old_count], fields[TOKENS][:old_count])
        if TOKENS in changed and not grew:
            self.tokens_rewritten_at = self.version
        self.token_count_at[self.version] = len(self.tokens)
        self.token_count_at.pop(self.version - TOKEN_HISTORY, None)

    def changes_since(self, version: int) -> list[FieldDelta]:
        """What a client at `version` needs to reach the current version."""
        changes = [codec.delete(name) for name, at in self.deleted_at.items() if at > version]
        for name, value in self.fields.items():
            if self.changed_at.get(name, 0) <= version:
                continue
            old = None
            if name == TOKENS and version >= self.tokens_rewritten_at and version in self.token_count_at:
                old = value[:self.token_count_at[version]]   # the client's tokens: diff sends the suffix
            changes.append(codec.diff(name, old, value))
        return [c for c in changes if c is not None]

    def describe(self) -> dict:
        return {"id": self.id, "version": self.version, "tokens": int(len(self.tokens)),
                "fields": sorted(n for n in self.fields if n != TOKENS), "bytes": self.nbytes}
