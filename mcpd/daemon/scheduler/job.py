"""A request the scheduler holds: queued, then on a worker, until its final reply."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mcpd.contexts.chat import ChatTurn
from mcpd.contexts.context import Context
from mcpd.daemon.messages import Request
from mcpd.protocol.results import Degraded


@dataclass(slots=True)
class Job:
    rid: int
    request: Request | None           # None only in tests of the queues, which never read it
    payload: list[bytes]              # the client's payload frames
    class_name: str = ""
    client: str = ""
    cost: int = 1                     # tokens of work it stands for (its prompt's and the most it may generate)
    length_bin: int = 0               # prompt length rounded up to a power of two (as its bit length)
    prefills: bool = False            # a generate: worth holding a moment to batch with others
    deadline: float | None = None     # monotonic; None = no deadline
    degraded: Degraded | None = None  # the degradation ladder shortened it (its args hold the cap)
    seq: int = 0                      # arrival order, daemon-wide
    tag: float = 0.0                  # its start tag among its class's tenants (fair_queue.py)
    enqueued: float = field(default_factory=time.monotonic)
    rank: int = 0                     # effective rank when dispatched (after aging)
    started_streaming: bool = False
    retries: int = 0
    context: Context | None = None    # a generate turn on a context, held until it ends
    history: bytes | None = None      # a turn's context tokens (int32), for its worker
    context_version: int | None = None   # an infer's context: the version its fields were read from
    # An infer whose context fields were resolved: the request and payload as the client sent
    # them, which is what a resend is checked against in the poison list (poison.py).
    as_sent: tuple[Request, list[bytes]] | None = None
    chat: ChatTurn | None = None      # a turn of messages: what it keeps of the history, its conversation
    prompt_ids: list[int] = field(default_factory=list)   # a generate's new prompt tokens (prompt_tokens.py)
    served: tuple[str, str] | None = None   # the (model, version) it runs on (traffic.py); None: any worker
    compare: bool = False             # a side of a shadow pair (shadow.py): it answers through the scheduler
    dispatched: float = 0.0           # when it went to its worker (monotonic)
    queued: float = 0.0               # traced only: when its wait in the queue began (after admission)

    @property
    def suspect(self) -> bool:
        """It was on a worker that died or failed a step: it runs alone there, so that if it is
        the cause it fails alone (router.rooms)."""
        return self.retries > 0
