"""A store listener, the last, noting which contexts were opened or changed and which dropped
since the heartbeat last took them: what the cluster's recency index (recency.py) hears of this
node. It runs on the scheduler's loop, so it only notes; the heartbeat thread writes to Redis."""
from __future__ import annotations

from mcpd.contexts.context import Context
from mcpd.contexts.record import Record


class UsedContexts:
    def __init__(self):
        self.used: dict[tuple[str, str], None] = {}      # insertion-ordered sets
        self.forgotten: dict[tuple[str, str], None] = {}

    def take(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The contexts used and dropped since the last take, oldest first."""
        taken = list(self.used), list(self.forgotten)
        self.used, self.forgotten = {}, {}
        return taken

    def opened(self, context: Context) -> None:
        self._use(context)

    def committed(self, context: Context, record: Record) -> None:
        self._use(context)

    def adopted(self, context: Context) -> None:
        """A copy from the shared store is no use of it: its next commit, if any, is."""

    def reverted(self, context: Context) -> None:
        """Heard only by listeners before the one that refused: never this one, the last."""

    def dropped(self, context: Context) -> None:
        key = (context.owner, context.id)
        self.used.pop(key, None)
        self.forgotten[key] = None

    def _use(self, context: Context) -> None:
        key = (context.owner, context.id)
        self.used.pop(key, None)   # to the end: the newest last
        self.used[key] = None
        self.forgotten.pop(key, None)
