"""The context ops of the protocol (context.open/get/update/drop/list) on top of the store,
and the two hooks a context generate needs: take the context for a turn, then commit the turn.

It runs inside the scheduler: that process sees every context generate (to route it to the
worker holding its KV, and to hold updates off while it runs), so the table lives there.

The store comes from persistence.py, restored and with its listeners (the host cache, the
journal) in place. When one cannot hold a version it refuses it (the cache: TOO_LARGE past the
tenant's share, STORAGE_FULL when full; the journal: STORAGE_FULL when the disk is full) and the
store puts the context back as it was.
"""
from __future__ import annotations

import numpy as np

from mcpd.contexts import chat
from mcpd.contexts.context import Context
from mcpd.contexts.persistence import Persistence
from mcpd.daemon.child_stats import ContextsStats
from mcpd.protocol import args as typed
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.results import ContextTurn

OPS = ("context.open", "context.get", "context.update", "context.drop", "context.list")


class ContextService:
    def __init__(self, persistence: Persistence):
        self.store = persistence.store
        self.cache = persistence.cache
        self.shared = persistence.shared

    def handle(self, tenant: str, args: typed.OpArgs, payload: list[bytes]) -> tuple[dict, list[bytes]]:
        """Run one context op (its args as the front-end checked them); returns (result map,
        payload frames) or raises MCPDError."""
        handler = getattr(self, "_" + args.op.removeprefix("context."))
        return handler(tenant, args, payload)

    def _open(self, owner: str, args: typed.ContextOpenArgs, _payload) -> tuple[dict, list[bytes]]:
        context, created = self.store.open(owner, args.id, args.create)
        return {**context.describe(), "created": created}, []

    def _get(self, owner: str, args: typed.ContextGetArgs, _payload) -> tuple[dict, list[bytes]]:
        since = args.since or 0
        context = self.store.get(owner, args.id, since)
        if since > context.version:
            raise MCPDError(codes.BAD_REQUEST, f"since = {since} is newer than the context ({context.version})")
        entries, frames = codec.to_wire(context.changes_since(since))
        return {"id": context.id, "version": context.version, "since": since, "changes": entries}, frames

    def _update(self, owner: str, args: typed.ContextUpdateArgs, payload: list[bytes]) -> tuple[dict, list[bytes]]:
        changes = codec.from_wire(args.changes, payload, self.store.limits)   # DeltaError is an MCPDError
        context = self.store.update(owner, args.id, args.base, changes)
        return {"id": context.id, "version": context.version}, []

    def _drop(self, owner: str, args: typed.ContextDropArgs, _payload) -> tuple[dict, list[bytes]]:
        return {"dropped": self.store.drop(owner, args.id)}, []

    def _list(self, owner: str, _args, _payload) -> tuple[dict, list[bytes]]:
        return {"contexts": [c.describe() for c in self.store.owned_by(owner)]}, []

    # -- generate on a context ------------------------------------------------------------------

    def begin_turn(self, owner: str, context_id: str, base: int | None, rid: int) -> tuple[Context, np.ndarray]:
        """Hold the context for a generate; returns it and its token ids."""
        context = self.store.writable(owner, context_id, base)
        context.busy_with = rid
        return context, context.tokens

    @staticmethod
    def end_turn(context: Context) -> None:
        context.busy_with = None

    def commit_turn(self, context: Context, token_ids: list[int], turn: chat.ChatTurn | None = None,
                    answer: str = "") -> ContextTurn:
        """Append the turn's prompt and output tokens (a chat turn: after the tokens it kept, with
        the conversation and its `answer`); returns what the reply says of the context."""
        held = len(context.tokens)
        keep = held if turn is None else turn.keep
        fields = {} if turn is None else {chat.FIELD: turn.record(answer, keep + len(token_ids))}
        try:
            self.store.commit_turn(context, keep, token_ids, fields)   # may refuse: TOO_LARGE
        finally:
            self.end_turn(context)
        return ContextTurn(context.id, context.version, token_ids, None if keep == held else keep)

    def catch_up(self, now: float) -> None:
        if self.shared is not None:
            self.shared.catch_up(now)

    def stats(self) -> ContextsStats:
        return ContextsStats(**self.store.stats(), **(self.cache.stats() if self.cache else {}),
                             redis=self.shared.stats() if self.shared else None)

