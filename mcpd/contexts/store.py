"""All contexts of the daemon, keyed by (owner, id): one tenant can never name another's.

Updates are all-or-nothing: deltas are applied to a copy of the field map and checked against
the limits before the new version is installed, so a bad frame leaves the context exactly as it
was. The one exception to copying is an XOR into a big array, applied to the live array itself
(see `_apply_in_place`) and undone, XOR being its own inverse, if anything later fails.

Listeners (the host shared-memory cache, then the on-disk journal, as persistence.py builds
them) hear of every context created (version 0), every committed version, with the record of the
deltas that made it from the version before (commit.py: encoded once, here, for all of them),
and of every drop: they keep copies that outlive this process. Any of them may refuse
by raising MCPDError (the cache when it cannot hold a version or the tenant's share is used up,
the journal when the disk is full), and then nothing happened anywhere, so no reply ever names a
version a restart would lose, and a refused one never comes back:
- an open or a commit goes to the listeners in order; when one refuses, the context is put back
  as it was (in-place XORs included) and those that took it hear `dropped` (an open) or
  `reverted` (a commit: go back to the context's version, which it is at again);
- a drop goes to them last to first, and only then leaves the store: the journal, the one that
  can refuse a drop, hears it before the cache deletes anything.
`restore` puts a saved copy back (at start, before any change) without telling them again.

In a cluster (docs/CLUSTER.md) `shared` is the copy every node shares (Redis, a listener too): a
context this node lacks is looked up there at first use and adopted (every other listener hears
`adopted` and keeps it whole). When the shared copy is ahead of this node's (another node
committed), the commit is refused with StaleCopy and this node forgets its copy, so the next
request adopts the shared one; a request naming a version newer than this node's copy (a base, a
`since`) adopts it at once.

Commits cost what they change: the context's byte count is kept up to date from the fields a
version touches, not summed over every field at each commit, and contexts.max_fields bounds how
many a context may have.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from mcpd.config import ContextsConfig
from mcpd.contexts import commit
from mcpd.contexts.context import TOKENS, Context
from mcpd.contexts.record import Record
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.delta import DeltaError, DeltaLimits, FieldDelta

# A full disk or cache has room again when an operator or other tenants act, not within
# milliseconds: clients told to wait a second do not spin on it.
STORAGE_RETRY_MS = 1000


def storage_full(message: str) -> MCPDError:
    return MCPDError(codes.STORAGE_FULL, message, retry_after_ms=STORAGE_RETRY_MS)


class StaleCopy(MCPDError):
    """A listener holds a newer version than this node's copy: another node committed one."""

    def __init__(self, message: str):
        super().__init__(codes.CONFLICT, message)


class SharedContexts(Protocol):
    def load(self, owner: str, context_id: str) -> Context | None: ...


class StoreListener(Protocol):
    def opened(self, context: Context) -> None: ...

    def committed(self, context: Context, record: Record) -> None: ...   # commit.encode's

    def reverted(self, context: Context) -> None: ...   # the commit after context.version was refused

    def dropped(self, context: Context) -> None: ...

    def adopted(self, context: Context) -> None: ...   # a whole context from elsewhere (the shared copy)


class ContextStore:
    def __init__(self, config: ContextsConfig, listeners: tuple[StoreListener, ...] = ()):
        self.config = config
        self.listeners = list(listeners)
        self.limits = DeltaLimits(max_field_bytes=config.max_field_bytes)
        self.contexts: dict[tuple[str, str], Context] = {}
        self.owned: dict[str, dict[str, Context]] = {}   # the same contexts by owner, then id
        self.total_bytes = 0                 # of all contexts, kept up to date on every commit
        self.bytes_of: dict[str, int] = {}   # of each owner's contexts
        self.shared: SharedContexts | None = None   # where a context this node lacks is looked up

    def open(self, owner: str, context_id: str, create: bool = True) -> tuple[Context, bool]:
        found = self._find(owner, context_id)
        if found is not None:
            return found, False
        if not create:
            raise self._not_found(context_id)
        context = Context(context_id, owner)
        self._announce(context, "opened")   # an opened context is acknowledged state too: it must outlive a restart
        return context, True

    def get(self, owner: str, context_id: str, known: int = 0) -> Context:
        """`known`: a version of the context a client was answered. A copy older than it is behind
        (another node committed since this one last held it): the shared copy replaces it."""
        context = self._find(owner, context_id)
        if context is None:
            raise self._not_found(context_id)
        if context.version < known and self.shared is not None and context.busy_with is None:
            return self._take_shared(context)
        return context

    def _take_shared(self, behind: Context) -> Context:
        """The shared copy in place of this node's, when it is newer; this node's otherwise."""
        shared = self.shared.load(behind.owner, behind.id)
        if shared is None or shared.version <= behind.version:
            return behind
        self._remove(behind)
        self._announce(shared, "adopted")
        return shared

    def _find(self, owner: str, context_id: str) -> Context | None:
        """This node's copy, or else the shared one, adopted."""
        context = self.contexts.get((owner, context_id))
        if context is None and self.shared is not None:
            context = self.shared.load(owner, context_id)
            if context is not None:
                self._announce(context, "adopted")
        return context

    def adopt(self, context: Context) -> bool:
        """Hold a context read from the shared copy ahead of its first use (a prefetch), unless this
        node holds one of that name already; whether it did."""
        if (context.owner, context.id) in self.contexts:
            return False
        self._announce(context, "adopted")
        return True

    def _announce(self, context: Context, event: str) -> None:
        """Hold a new context if there is room and every listener takes it (`event`: opened or adopted)."""
        if len(self.owned.get(context.owner, ())) >= self.config.max_per_owner:
            raise MCPDError(codes.TOO_LARGE, f"tenant holds {self.config.max_per_owner} contexts, the limit "
                                             "(contexts.max_per_owner)")
        if len(self.contexts) >= self.config.max_contexts:
            raise MCPDError(codes.TOO_LARGE, f"the daemon holds {self.config.max_contexts} contexts, the limit "
                                             "(contexts.max_contexts)")
        if context.nbytes:   # adopted from another node, which may run with larger limits
            self._growth(Context(context.id, context.owner), context.fields, set(context.fields))
        self._add(context)
        accepted = []
        try:
            for listener in self.listeners:
                # The shared copy is not told of what it just gave: writing the context back would cost
                # its whole size again, and would bring back a context another node dropped meanwhile.
                if event == "adopted" and listener is self.shared:
                    continue
                getattr(listener, event)(context)
                accepted.append(listener)
        except BaseException:
            self._remove(context)
            for listener in reversed(accepted):
                listener.dropped(context)
            raise

    def update(self, owner: str, context_id: str, base: int, changes: list[FieldDelta]) -> Context:
        context = self.writable(owner, context_id, base)
        if any(change.kind == "delete" and change.name == TOKENS for change in changes):
            raise MCPDError(codes.BAD_REQUEST, "the tokens field cannot be deleted")
        fields = dict(context.fields)
        in_place: list[FieldDelta] = []   # applied to the live arrays: undone if the update fails

        def apply(old, change: FieldDelta):
            if self._apply_in_place(old, change):
                in_place.append(change)
                return old
            return self._apply(old, change)

        def undo_in_place() -> None:
            while in_place:   # XOR undoes itself
                change = in_place.pop()
                codec.apply_in_place(fields[change.name], change, self.limits)
        try:
            changed, deleted = commit.apply_changes(fields, changes, apply)
            self._install(context, fields, changed, deleted, changes, undo_in_place)
        except BaseException:
            undo_in_place()
            raise
        return context

    def append_tokens(self, context: Context, token_ids: list[int]) -> None:
        """Commit a generate turn: the prompt it added and the tokens it produced."""
        self.commit_turn(context, len(context.tokens), token_ids, {})

    def commit_turn(self, context: Context, keep: int, token_ids: list[int], fields: dict) -> None:
        """Commit a generate turn that kept the first `keep` tokens and added `token_ids` after
        them, with other `fields` it set (a chat turn's record) in the same version."""
        tokens = np.concatenate([context.tokens[:keep], np.asarray(token_ids, np.int32)])
        self._commit_values(context, {TOKENS: tokens, **fields})

    def commit_fields(self, context: Context, values: dict[str, np.ndarray]) -> None:
        """Commit new arrays for some fields (never tokens: field_window.py refuses it) as one
        version: an infer's appended windows, held to the field limit as a client's deltas are."""
        for name, value in values.items():
            if value.nbytes > self.limits.max_field_bytes:
                raise MCPDError(codes.TOO_LARGE, f"field {name!r} would hold {value.nbytes} bytes; the limit is "
                                                 f"{self.limits.max_field_bytes} (contexts.max_field_bytes)")
        self._commit_values(context, values)

    def _commit_values(self, context: Context, values: dict) -> None:
        """Commit the fields' new values as the next version, each recorded as its smallest delta."""
        changes = [codec.diff(name, context.fields.get(name), value) for name, value in values.items()]
        self._install(context, dict(context.fields, **values), set(values), set(), [c for c in changes if c])

    def writable(self, owner: str, context_id: str, base: int | None) -> Context:
        """The context, if a change based on `base` may be applied to it now."""
        context = self.get(owner, context_id, base or 0)
        if context.busy_with is not None:
            raise MCPDError(codes.CONFLICT, f"context {context_id!r} is busy with a generate; retry when it ends")
        if base is not None and base != context.version:
            raise MCPDError(codes.CONFLICT, f"context {context_id!r} is at version {context.version}, "
                                            f"not {base}: fetch the changes since {base} and retry")
        return context

    def drop(self, owner: str, context_id: str) -> bool:
        context = self._find(owner, context_id)
        if context is None:
            return False
        if context.busy_with is not None:
            raise MCPDError(codes.CONFLICT, f"context {context_id!r} is busy with a generate")
        taken = []
        try:
            for listener in reversed(self.listeners):
                listener.dropped(context)
                taken.append(listener)
        except BaseException:
            for listener in taken:   # the shared copy, dropped before the journal refused: back again
                listener.adopted(context)
            raise
        self._remove(context)
        return True

    def restore(self, context: Context) -> None:
        """Put back a context a listener saved (persistence.py, once, at start)."""
        self._add(context)

    def owned_by(self, owner: str) -> list[Context]:
        return sorted(self.owned.get(owner, {}).values(), key=lambda c: c.id)

    def _add(self, context: Context) -> None:
        self.contexts[(context.owner, context.id)] = context
        self.owned.setdefault(context.owner, {})[context.id] = context
        self._account(context.owner, context.nbytes)

    def _remove(self, context: Context) -> None:
        del self.contexts[(context.owner, context.id)]
        owned = self.owned[context.owner]
        del owned[context.id]
        if not owned:
            del self.owned[context.owner]
        self._account(context.owner, -context.nbytes)

    def _apply_in_place(self, old, change: FieldDelta) -> bool:
        """XOR a big field's live array instead of building a new one: a sync of a 64 MB field then
        costs no 64 MB allocation (page faults and a copy's memory traffic). Token ids are left
        alone: Context.commit compares the old tokens with the new to tell growth from rewrites."""
        if change.name == TOKENS:
            return False
        try:
            return codec.apply_in_place(old, change, self.limits)
        except DeltaError as e:
            raise MCPDError(e.code, f"field {change.name!r}: {e.message}") from None

    def _apply(self, old, change: FieldDelta):
        try:
            value = codec.apply(old, change, self.limits)
        except DeltaError as e:
            raise MCPDError(e.code, f"field {change.name!r}: {e.message}") from None
        if change.name == TOKENS and not _is_token_array(value):
            raise MCPDError(codes.BAD_REQUEST, "the tokens field must be a 1-D array of non-negative int32")
        return value

    def _growth(self, context: Context, fields: dict, touched: set[str]) -> int:
        """How many bytes `fields` (which differ from the context's in `touched`) add; TOO_LARGE
        if that takes the context, its owner or the daemon past a limit, or the context past
        contexts.max_fields. The owner's limit keeps one tenant from taking the whole daemon-wide
        budget from the others."""
        if len(fields) - 1 > self.config.max_fields and len(fields) > len(context.fields):
            raise MCPDError(codes.TOO_LARGE, f"context {context.id!r} would have {len(fields) - 1} fields besides "
                                             f"tokens; the limit is {self.config.max_fields} (contexts.max_fields)")
        size = context.nbytes_after(fields, touched)
        growth = size - context.nbytes
        limits = ((size, self.config.max_context_bytes, "context would hold", "max_context_bytes"),
                  (self.bytes_of.get(context.owner, 0) + growth, self.config.max_owner_bytes,
                   "the tenant's contexts would hold", "max_owner_bytes"),
                  (self.total_bytes + growth, self.config.max_total_bytes, "contexts would hold", "max_total_bytes"))
        for would_hold, limit, what, key in limits:
            if would_hold > limit:
                raise MCPDError(codes.TOO_LARGE, f"{what} {would_hold} bytes; the limit is {limit} (contexts.{key})")
        return growth

    def _account(self, owner: str, growth: int) -> None:
        self.total_bytes += growth
        self.bytes_of[owner] = self.bytes_of.get(owner, 0) + growth

    def _install(self, context: Context, fields: dict, changed: set[str], deleted: set[str],
                 changes: list[FieldDelta], undo_in_place=lambda: None) -> None:
        """Commit the next version if it fits the limits and every listener takes it."""
        growth = self._growth(context, fields, changed | deleted)
        saved = context.saved()
        context.commit(fields, changed, deleted, context.nbytes + growth)
        accepted = []
        try:
            record = commit.encode(context, changes)
            for listener in self.listeners:
                listener.committed(context, record)
                accepted.append(listener)
        except BaseException as refusal:
            context.roll_back(saved)
            undo_in_place()
            for listener in reversed(accepted):
                listener.reverted(context)
            if isinstance(refusal, StaleCopy):
                self._remove(context)
            raise
        self._account(context.owner, growth)

    @staticmethod
    def _not_found(context_id: str) -> MCPDError:
        # The same answer whether the id is unused or another tenant's: existence does not leak.
        return MCPDError(codes.NOT_FOUND, f"no context {context_id!r}")

    def stats(self) -> dict:
        return {"contexts": len(self.contexts), "bytes": self.total_bytes}


def _is_token_array(value) -> bool:
    return (isinstance(value, np.ndarray) and value.dtype == np.int32 and value.ndim == 1
            and (value.size == 0 or int(value.min()) >= 0))
