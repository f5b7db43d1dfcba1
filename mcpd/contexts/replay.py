"""Rebuilding contexts from saved records: the journal's stream of them (Replay, which keeps
count of what damage cost) and a host cache chain (replay_chain). Both replay a commit the one
way (Commit.apply_to).

A snapshot record ("context") holds a whole context; journal records ("open", "commit", "drop")
change one, in the order the store made the changes. Replay applies every record it can:
- "open" starts a fresh context: the store writes one only when it creates a context, so an
  open for a context replay already holds means the drop before it was lost to damage;
- "commit" of version v applies to the context at v - 1; version 1 applies to a fresh context
  whatever replay held (its drop and open were lost); a commit after a gap (an earlier version
  was lost to damage) cannot apply, and neither can any later one of that context: the context
  stays at its last good version and those versions are lost (damage costs at most that
  context's later versions);
- "drop" removes the context.
A record whose checksums held but whose content cannot be applied (a bug, or limits it was never
checked against) is lost the same way: never a reason not to start. Deltas are replayed under
REPLAY_LIMITS: a journal written under a larger contexts.max_field_bytes restores whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.contexts import commit, journal_file, snapshot
from mcpd.contexts.commit import Commit
from mcpd.contexts.context import Context


@dataclass
class LostVersions:
    first: int
    last: int


class Replay:
    def __init__(self):
        self.contexts: dict[tuple[str, str], Context] = {}
        self.lost: dict[tuple[str, str], LostVersions] = {}
        self.applied = 0          # records applied
        self.unusable = 0         # records read whole that could not be applied
        self.generation = 0       # the highest snapshot generation a record names

    def apply(self, record: dict) -> None:
        try:
            getattr(self, "_" + record["op"])(record)
        except Exception:   # noqa: BLE001 - a record that cannot be applied costs itself, never the start
            self.unusable += 1
            self._lose(record)
            return
        self.applied += 1

    def lost_summary(self, limit: int = 20) -> str:
        """The contexts that lost versions and what they came back at, for the log."""
        parts = []
        for (owner, context_id), lost in list(self.lost.items())[:limit]:
            context = self.contexts.get((owner, context_id))
            now = f"restored at version {context.version}" if context is not None else "not restored"
            parts.append(f"{owner}/{context_id} versions {lost.first}-{lost.last} lost ({now})")
        more = len(self.lost) - limit
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")

    # -- records --------------------------------------------------------------------------------

    def _generation(self, record: dict) -> None:
        self.generation = max(self.generation, int(record["generation"]))

    def _context(self, record: dict) -> None:
        context = snapshot.decode(journal_file.record_of(record))
        self.contexts[(context.owner, context.id)] = context
        self.generation = max(self.generation, int(record.get("generation", 0)))

    def _open(self, record: dict) -> None:
        self.contexts[(record["owner"], record["id"])] = Context(record["id"], record["owner"])

    def _drop(self, record: dict) -> None:
        self.contexts.pop((record["owner"], record["id"]), None)

    def _commit(self, record: dict) -> None:
        made = commit.decode(journal_file.record_of(record))
        key, version = (made.owner, made.context_id), made.version
        context = self.contexts.get(key)
        if version == 1 and (context is None or context.version != 0):
            context = Context(made.context_id, made.owner)   # its drop and open were lost
        elif context is None or version > context.version + 1:
            self._lose(record, context.version + 1 if context is not None else version)
            return
        elif version <= context.version:
            return   # folded into the snapshot already
        made.apply_to(context)
        self.contexts[key] = context

    def _lose(self, record: dict, since: int | None = None) -> None:
        """Note the versions lost up to the one a record would have made (from `since`: those
        between were in the damaged bytes), if it names one."""
        try:
            key, version = (str(record["owner"]), str(record["id"])), int(record["version"])
        except (KeyError, TypeError, ValueError):
            return
        lost = self.lost.setdefault(key, LostVersions(version, version))
        lost.first, lost.last = min(lost.first, version if since is None else since), max(lost.last, version)


def replay_chain(context: Context, commits: list[Commit]) -> list[Commit]:
    """Bring a snapshot's context up through the commits that follow it, in version order, until
    a gap or one that does not apply; returns those applied. The others cannot be reached: at or
    below the snapshot (a crash before the chain it replaced was deleted), or past the gap."""
    applied = []
    for made in sorted(commits, key=lambda c: c.version):
        if made.version != context.version + 1:
            continue
        try:
            made.apply_to(context)
        except Exception:   # noqa: BLE001 - damaged memory: the context stays at its last good version
            break
        applied.append(made)
    return applied
