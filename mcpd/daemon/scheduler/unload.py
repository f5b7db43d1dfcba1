"""A version being unloaded (models.unload): the ops waiting for it, and which of its workers have
yet to show that their replies reached the front-end.

A worker sends its replies to the front-end and its Done notes to the scheduler on two sockets, so
a version's last Done can arrive while its last finals are still in the worker (one that has just
started may not even be connected to the front-end yet); stopping the worker then loses them. So
once the version has no request queued or running, each of its workers is sent Flush: it puts a
Flushed marker behind its replies on its socket to the front-end, which relays them and then passes
the marker on here. The unload is answered, and the supervisor stops the workers, only when every
worker asked has flushed or is gone.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Unload:
    tokens: list[int] = field(default_factory=list)   # the ops waiting, answered together
    flushing: set[bytes] | None = None   # workers asked to flush and not heard from; None: not asked yet

    @property
    def asked(self) -> bool:
        return self.flushing is not None

    @property
    def done(self) -> bool:
        return self.flushing is not None and not self.flushing

    def forget(self, identity: bytes) -> None:
        """The worker flushed, or is gone: nothing more of it to wait for."""
        if self.flushing:
            self.flushing.discard(identity)
