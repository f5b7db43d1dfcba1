"""What a starting journal finds on disk: every context it can rebuild, and what damage cost.

recover() reads <state_dir>/contexts/ (the snapshot, then the journal of its generation), and
replays every record whose checksums hold (journal_file.py, replay.py). It never stops a
start over what it finds, and never destroys a byte of it:
- damaged files (unreadable ranges, records that cannot be applied) are kept as they are in
  <state_dir>/contexts.damaged-<UTC time>/ as hard links: the names in contexts/ keep the bytes
  until the journal writes a clean snapshot in their place, and the copies stay for the operator;
- what is not a regular file (a directory or a link where the journal should be, a file where
  the contexts directory should be) or cannot be read is moved into that directory: it holds
  nothing the journal could use.
Only an error it cannot work around (the state dir cannot be written, so nothing can be set
aside) raises OSError; the journal then refuses context changes rather than restart in a loop.
"""
from __future__ import annotations

import itertools
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from mcpd.contexts import journal_file
from mcpd.contexts.journal_file import Contents
from mcpd.contexts.replay import Replay

SNAPSHOT = "snapshot"
TEMPORARY = SNAPSHOT + ".tmp"   # a snapshot being written: never read, never kept


@dataclass
class Recovery:
    replay: Replay
    generation: int
    read_format: int = 2                             # 1 if any file read was format 1: to migrate
    damage: list[str] = field(default_factory=list)  # what was found, for the log
    damaged_bytes: int = 0
    aside: Path | None = None                        # where the damaged files are kept

    @property
    def damaged(self) -> bool:
        return bool(self.damage or self.replay.lost or self.replay.unusable)

    def describe(self) -> str:
        replay = self.replay
        lines = [f"context journal damaged: {'; '.join(self.damage) or 'no unreadable bytes'}",
                 f"{replay.applied} record(s) recovered, {replay.unusable} unusable"]
        if replay.lost:
            lines.append(f"contexts with lost versions: {replay.lost_summary()}")
        lines.append(f"the damaged files are kept in {self.aside}; a clean snapshot of what was recovered "
                     "replaces them")
        return "; ".join(lines)


def recover(state_dir: Path) -> Recovery:
    directory, aside = state_dir / "contexts", _Aside(state_dir)
    found: list[str] = []
    if _kind(directory) not in (None, "dir"):
        aside.move(directory)
        found.append(f"{directory} is not a directory: moved aside")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    replay = Replay()
    snapshot = _read(directory / SNAPSHOT, aside, found)
    for record in snapshot.records:
        replay.apply(record)
    generation = replay.generation or (_newest_journal(directory) if snapshot.damage else 0)
    journal = _read(directory / f"journal-{generation}.log", aside, found)
    for record in journal.records:
        replay.apply(record)
    recovery = Recovery(replay, generation, min(snapshot.format, journal.format), found,
                        snapshot.damaged_bytes + journal.damaged_bytes)
    if recovery.damaged:
        for path in directory.iterdir():
            if path.name != TEMPORARY and _kind(path) == "file":
                aside.keep(path)
    recovery.aside = aside.path
    return recovery


def _read(path: Path, aside: "_Aside", found: list[str]) -> Contents:
    kind = _kind(path)
    if kind is None:
        return Contents(2)
    if kind != "file":
        aside.move(path)
        found.append(f"{path.name} is not a regular file ({kind}): moved aside")
        return Contents(2)
    try:
        contents = journal_file.read(path)
    except OSError as e:
        aside.move(path)
        found.append(f"{path.name} cannot be read ({e.strerror}): moved aside")
        return Contents(2)
    if contents.damage:
        first = ", ".join(f"{length} at offset {offset}" for offset, length in contents.damage[:5])
        found.append(f"{path.name}: {contents.damaged_bytes} unreadable byte(s) in {len(contents.damage)} "
                     f"place(s) ({first}{', ...' if len(contents.damage) > 5 else ''})")
    return contents


def _newest_journal(directory: Path) -> int:
    """The generation a damaged snapshot was written for: its journal's, the newest there."""
    numbers = [path.name[len("journal-"):-len(".log")] for path in directory.glob("journal-*.log")]
    return max((int(n) for n in numbers if n.isdigit()), default=0)


def _kind(path: Path) -> str | None:
    """'file', 'dir', another kind, or None when absent; links are not followed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return "file"
    return "dir" if stat.S_ISDIR(mode) else ("link" if stat.S_ISLNK(mode) else "special file")


class _Aside:
    """<state_dir>/contexts.damaged-<UTC time>[-n], made when first needed."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.path: Path | None = None

    def move(self, path: Path) -> None:
        os.rename(path, self._directory() / path.name)

    def keep(self, path: Path) -> None:
        """A copy of the file's bytes as they are now; the name in contexts/ is replaced later."""
        target = self._directory() / path.name
        try:
            os.link(path, target)
        except OSError:   # a file system without hard links
            shutil.copy2(path, target)

    def _directory(self) -> Path:
        if self.path is None:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            for n in itertools.count():
                path = self.state_dir / (f"contexts.damaged-{stamp}" + (f"-{n}" if n else ""))
                try:
                    path.mkdir(mode=0o700)
                except FileExistsError:
                    continue
                self.path = path
                break
        return self.path
