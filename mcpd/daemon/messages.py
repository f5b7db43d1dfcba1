"""The messages between mcpd's processes, declared once, and their one encoding.

A message is the frames [tag, body, *payload]: the tag names its type, the body is its fields as
a msgpack array (msgspec encodes it, and decodes it straight into the declared type, once per
process), and the payload is bytes that travel as they are: a request's client frames, a prompt's
token ids, a reply header for a client. Where the frames go is channels.py's map.

    front-end → scheduler   Request (+ the client's payload)   Cancel
    supervisor → scheduler  WorkerLost  Admin (scheduler/admin.py)  Reload (live_config.py)
    scheduler → worker      Dispatch (its prompt's token ids; + a context turn's history: its
                            token ids, int32)   Cancel   Welcome (its Hello was read)   Flush
    worker → scheduler      Hello  Started  Done  Stats  Failed;  a context turn's Chunk, Final
                            (Reload: the scheduler passes it on to every worker)
                            and TurnResult (Dispatch.turn: the scheduler commits the turn first)
    worker → front-end      Chunk, Final (+ the reply header for the client, *payload)   Flushed
    front-end → scheduler   Flushed (passed on once the worker's replies before it were relayed)
    scheduler → front-end   Final (+ reply header, *payload)   Members (the cluster's, at each stats report)
                            Shed (classes to refuse at the edge, for a lease)
    supervisor → front-end  Drain  SchedulerLost  Resume  (no body)   Reload
    every child → supervisor  Ready  Report (its typed stats: child_stats.py)  Drained  Refused
                            AdminAnswer (the scheduler's, to Admin)  Reloaded (each process's, to Reload)

Messages bound for one socket in one turn of a process's loop may travel as one: a batch,
[BATCH, their frames as one msgpack array of arrays] (pack, unpack; batch.py holds and sends
them). Each wake-up of the receiver and of the ZeroMQ I/O threads between then carries many
messages instead of one, which is what pipelined requests cost most (bench/overhead.py). A lone
message travels as itself.

Internal messages are trusted (channels.py says why): a body that does not decode is a bug, and
raises.
"""
from __future__ import annotations

from typing import ClassVar

import msgspec

from mcpd.daemon import child_stats
from mcpd.daemon.child_stats import WorkerStats
from mcpd.daemon.model_stats import Signature
from mcpd.config import Config
from mcpd.protocol import control_args, control_results
from mcpd.protocol.args import ANY_ARGS, GenerateArgs, InferArgs, PingArgs
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.results import Degraded, GenerateResult


class Message(msgspec.Struct, frozen=True, array_like=True):
    TAG: ClassVar[bytes]


class Request(Message):
    """A client request that passed every check of the front-end."""
    TAG = b"REQ"
    rid: int                  # the front-end's internal request number, unique for the daemon's life
    request_id: int | str     # the client's id, named in every reply
    tenant: str
    priority: str | None      # the class the client asked for: the scheduler judges it (it may reload)
    timeout_ms: int | None
    args: ANY_ARGS
    trace: str | None = None   # the traceparent of its root span, when traced (mcpd/tracing/)
    sent: float | None = None   # when its sender sent it (time.monotonic()), for a traced request's hop span
    received: float | None = None   # when the front-end read it (time.monotonic()): its wait on the way (edge_shedding.py)


class Cancel(Message):
    """Stop a request. code: its final's error code, one of channels.CANCEL_REASONS."""
    TAG = b"CANCEL"
    rid: int
    code: str


class WorkerLost(Message):
    TAG = b"LOST"
    index: int
    pid: int


class Dispatch(Message):
    """A request handed to a worker."""
    TAG = b"DISPATCH"
    rid: int
    request_id: int | str
    tenant: str                 # namespaces the prefix cache: KV blocks are shared within a tenant only
    rank: int                   # the engine priority: the scheduler's effective rank of the request
    turn: bool                  # a context turn: its replies go back through the scheduler
    args: GenerateArgs | InferArgs | PingArgs   # a generate's sampling as the engine runs it (the ladder may
                                                # have shortened it); an infer's input i is payload frame i
    prompt_ids: list[int] = []  # a generate's new prompt tokens, tokenized once by the scheduler
    compare: bool = False       # a side of a shadow pair (scheduler/shadow.py): its replies go back
                                # through the scheduler, which compares the two, as a turn's do
    degraded: Degraded | None = None   # the ladder shortened it: its result says so
    trace: str | None = None    # the traceparent of its request's root span, when traced
    context_version: int | None = None   # an infer whose inputs came from a context: its version, for the reply
    sent: float | None = None   # when its sender sent it (time.monotonic()), for a traced request's hop span


class Hello(Message):
    TAG = b"HELLO"
    index: int
    pid: int
    device: str
    model: str                 # the checkpoint's own name
    dtype: str
    served_model: str = ""     # the model table's name of what it serves (config/models.py), and its version
    version: str = ""
    signature: Signature | None = None   # a handler's; None: a language model's worker


class Welcome(Message):
    """The scheduler has read the worker's Hello. Only then does the worker tell the supervisor
    it is Ready: Hello and Ready go out on two sockets, so without it the daemon's READY could
    come before the scheduler knew of any worker (an HTTP request's model then looked unknown)."""
    TAG = b"WELCOME"


class Flush(Message):
    """The worker's version is being unloaded and has no request left: put a Flushed marker
    behind every reply sent so far (scheduler/unload.py)."""
    TAG = b"FLUSH"


class Flushed(Message):
    """Every reply worker `index` sent before this has reached the front-end, which relays them
    and then passes this on to the scheduler."""
    TAG = b"FLUSHED"
    index: int


class Started(Message):
    """A stream sent its first chunk: the request is no longer safe to retry elsewhere."""
    TAG = b"STARTED"
    rid: int


class Done(Message):
    """Requests answered (batched per worker loop turn)."""
    TAG = b"DONE"
    rids: list[int]


class Stats(Message):
    TAG = b"STATS"
    stats: WorkerStats


class Failed(Message):
    """An engine step raised: these requests were aborted unanswered; the scheduler decides."""
    TAG = b"FAILED"
    reason: str
    rids: list[int]


class Chunk(Message):
    TAG = b"CHUNK"
    rid: int


class Final(Message):
    """A request's last reply. code: the error code of an error reply, None for an ok one."""
    TAG = b"FINAL"
    rid: int
    code: str | None = None
    sent: float | None = None   # when its sender sent it (time.monotonic()), for a traced request's hop span


class TurnResult(Message):
    """A context turn ended well on its worker: the scheduler commits it, then builds the reply."""
    TAG = b"TURN"
    rid: int
    result: GenerateResult   # without its context: the scheduler adds it once committed
    appended: list[int]      # what the turn adds to the context: its prompt tokens and its output
    sent: float | None = None   # when its sender sent it (time.monotonic()), for a traced request's hop span


class OwnerNode(msgspec.Struct, frozen=True, array_like=True):
    tcp: str        # where its front-end is reached (cluster.advertise_tcp)
    weight: float   # its capacity: its share of contexts
    curve_key: str = ""   # its CURVE server key (Z85) with CURVE on; "" off


class Members(Message):
    """The live nodes that may own contexts, as the scheduler's heartbeat last saw them: the
    front-end routes each context's requests to its owner by them (frontend/forwarding.py), and
    plain requests away from this node while it is loaded by `queued` (cluster/offload.py)."""
    TAG = b"MEMBERS"
    nodes: dict[str, OwnerNode]
    queued: dict[str, int]   # the nodes' queued requests: others' as they last reported, this one's now


class Shed(Message):
    """Refuse new generate and infer requests of these classes at the front-end past `in_flight`
    of each, OVERLOADED with retry_after_ms, without forwarding them, for lease_ms
    (scheduler/edge_shedding.py decides, frontend/shed_table.py refuses and holds the lease while
    it does): a lease nothing holds ends by itself, so it cannot leave a class shed."""
    TAG = b"SHED"
    classes: list[str]
    retry_after_ms: int
    lease_ms: int
    in_flight: int


class Drain(Message):
    TAG = b"DRAIN"


class SchedulerLost(Message):
    TAG = b"SCHED_LOST"


class Resume(Message):
    TAG = b"RESUME"


class Admin(Message):
    """An mcpctl op that runs in the scheduler (the control-op table's), its args decoded by the
    supervisor; answered by an AdminAnswer event with the same token."""
    TAG = b"ADMIN"
    token: int
    op: str
    args: control_args.ANY


class Reload(Message):
    """The re-read config: each process applies what it can and confirms."""
    TAG = b"RELOAD"
    token: int
    config: Config   # its dataclasses, checked on decode; the supervisor checked their values


class Sender(msgspec.Struct, frozen=True, array_like=True):
    """The child an event comes from: the supervisor matches it to its process table entry."""
    role: str
    index: int
    pid: int


class Event(Message):
    """A child's one-way report to the supervisor (child.EventReporter sends them)."""
    sender: Sender


class Ready(Event):
    TAG = b"READY"


class Report(Event):
    TAG = b"REPORT"
    stats: child_stats.ANY


class Drained(Event):
    """The front-end has answered everything in flight after a Drain."""
    TAG = b"DRAINED"


class Refused(Event):
    """The child cannot start for a reason a restart will not fix (child.refuse_start)."""
    TAG = b"REFUSED"
    reason: str
    status: int   # the exit status the daemon stops with


class AdminAnswer(Event):
    """The scheduler's answer to Admin: a result (its op's struct, control_results.py), or an error."""
    TAG = b"ANSWER"
    token: int
    result: control_results.ANY | None = None
    error: ErrorReply | None = None


class Reloaded(Event):
    TAG = b"RELOADED"
    token: int
    applied: list[str]   # the keys this process applied live


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind.TAG: (kind, msgspec.msgpack.Decoder(kind)) for kind in (
    Request, Cancel, WorkerLost, Dispatch, Hello, Welcome, Flush, Flushed, Started, Done, Stats, Failed, Chunk,
    Final, TurnResult, Members, Shed,
    Drain, SchedulerLost, Resume, Admin, Reload, Ready, Report, Drained, Refused, AdminAnswer, Reloaded)}


# What a core hands its ports for one message: the message, then its payload frames (encode's arguments).
Outgoing = tuple[Message, *tuple[bytes, ...]]


def encode(message: Message, *payload: bytes) -> list[bytes]:
    if not message.__struct_fields__:
        return [message.TAG]
    return [message.TAG, _ENCODER.encode(message), *payload]


BATCH_TAG = b"BATCH"
_BATCH = msgspec.msgpack.Decoder(list[list[bytes]])


def pack(held: list[list[bytes]]) -> list[bytes]:
    """Several messages for one socket as one batch (unpack takes it apart): their frames in one
    msgpack frame, since ZeroMQ charges each frame of a message: many small frames cost many
    times one frame of their bytes, and each reply is several frames. A batch stays under
    batch.MAX_BYTES, so the copy this makes is bounded."""
    return [BATCH_TAG, _ENCODER.encode(held)]


def unpack(frames: list[bytes]) -> list[list[bytes]]:
    """The messages in what one receive took: a batch's, or the one message it is."""
    if frames[0] != BATCH_TAG:
        return [frames]
    return _BATCH.decode(frames[1])


def decode(frames: list[bytes]) -> tuple[Message, list[bytes]]:
    """(the message, its payload frames). Raises KeyError for a tag no message has."""
    kind, decoder = _DECODERS[bytes(frames[0])]
    if not kind.__struct_fields__:
        return kind(), []
    return decoder.decode(frames[1]), frames[2:]

