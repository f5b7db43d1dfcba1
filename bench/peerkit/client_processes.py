"""Client processes that offer one open-loop schedule together, for rates one Python process
cannot send on time (a burst at twice a fast server's capacity): each process has its own
FrameSender (its own socket, its frames built before the run), and sends every n-th arrival of
the schedule at the same start; their outcomes are merged. Each outcome keeps its lag, and each
run its CPU seconds, so a run where the processes still fall behind shows in generator_figures
(load.py) instead of passing for server latency.

With a premium sender, one more process sends every "high" arrival of an open loop, on its own
connection, as another tenant's client would: a premium client is not one of the flood's
connections, and its replies are not read by a process busy sending the flood.

The flood's processes run at CLIENT_NICE: in the deployments a burst stands for, the clients are
other machines and take none of the daemon's cores; on one box they yield the cores to it instead.
The premium process runs at PREMIUM_NICE, as the daemon does: it sends a tenth of the requests and
sleeps between them, so it takes little, but at CLIENT_NICE it queued for a core behind the
daemon and every neighbour each time it woke to send a high request or read its reply, and that
queue counted as the high request's latency. Each run's CPU seconds and lag still show whether
the processes kept to the schedule.

Processes start with `spawn` (a forked copy of a ZeroMQ context is not safe), once, and serve
every schedule handed to them until closed."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import numpy as np

from peerkit.frame_sender import OK, PRIORITIES
from peerkit.load import CLIENT_TIMEOUT_S, Outcome, arrivals, clock

START_LEAD_S = 0.5     # a schedule starts this long after it is handed out: every process has it by then
READY_TIMEOUT_S = 120  # a process imports numpy, zmq and mcpd, and builds its frames, before it is ready
WARM_INDEX = 0         # each process's first request, before it is ready: its socket is connected then
REPLY_MARGIN_S = 60    # past the schedule's end and the last reply's timeout: the process is stuck
CLIENT_NICE = 10      # below the daemon's processes (0); nice 10 weighs about a tenth of nice 0
PREMIUM_NICE = 0      # the daemon's: a high request's client must not queue for a core behind it
ID_SPAN = 1 << 28      # each process's request ids start this far apart: a daemon's span names one request


class ClientProcesses:
    """`count` processes, each sending through `make_sender()` (a FrameSender; picklable: built
    in the process) after building the frames of inputs 0..prepare-1; with `make_premium`, one
    more through that, for the open loops' high arrivals alone (closed loops: the `count` alone)."""

    def __init__(self, make_sender, count: int, prepare: int, make_premium=None):
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        self.flood = count   # the first `count` pipes; a premium process's is last
        self.started = 0.0   # the last open loop's start (monotonic): its outcomes' times count from it
        makers = [(make_sender, CLIENT_NICE)] * count + ([(make_premium, PREMIUM_NICE)] if make_premium else [])
        for k, (make, nice) in enumerate(makers):
            ours, theirs = context.Pipe()
            process = context.Process(target=_client_main, args=(theirs, make, prepare, k * ID_SPAN, nice), daemon=True)
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)
        for pipe in self.pipes:
            _received(pipe, READY_TIMEOUT_S)

    def pids(self) -> dict[str, int]:
        """Each process's pid by its part: flood0.., and premium when there is one."""
        named = {f"flood{k}": process.pid for k, process in enumerate(self.processes[:self.flood])}
        return named | {"premium": p.pid for p in self.processes[self.flood:]}

    async def open_loop(self, rate: float, seconds: float, pick, seed: int,
                        high_frac: float = 0.0) -> tuple[list[Outcome], float]:
        """load.open_loop's schedule, every process sending its share: (outcomes in schedule
        order, the CPU seconds the processes spent sending and reading)."""
        schedule = arrivals(rate, seconds, pick, seed, high_frac)
        at = np.array([arrival[0] for arrival in schedule], np.float64)
        index = np.array([arrival[1] for arrival in schedule], np.int64)
        priority = np.array([PRIORITIES.index(arrival[2]) for arrival in schedule], np.int8)
        start = self.started = clock() + START_LEAD_S
        parts = self._parts(priority)
        for pipe, part in zip(self.pipes, parts):
            pipe.send(("open", at[part], index[part], priority[part], start))
        limit = START_LEAD_S + seconds + CLIENT_TIMEOUT_S + REPLY_MARGIN_S
        shares = await asyncio.gather(*(asyncio.to_thread(_received, pipe, limit) for pipe in self.pipes))
        outcomes = [outcome for part, share in zip(parts, shares)
                    for outcome in _outcomes(share, at[part], priority[part], start)]
        return sorted(outcomes, key=lambda o: o.scheduled_s), sum(share["cpu_s"] for share in shares)

    def _parts(self, priority: np.ndarray) -> list[np.ndarray]:
        """Each process's arrivals (indices into the schedule): every n-th over the flood's, and
        with a premium process the high ones its alone."""
        premium = len(self.pipes) > self.flood
        high = priority == PRIORITIES.index("high")
        rest = np.flatnonzero(~high) if premium else np.arange(len(priority))
        return [rest[k::self.flood] for k in range(self.flood)] + ([np.flatnonzero(high)] if premium else [])

    async def closed_loop(self, clients: int, seconds: float, pick, seed: int) -> float:
        """load.closed_loop's requests/s with `clients` spread over the processes, summed: the
        capacity of a server one process's clients cannot saturate. `pick` must pickle."""
        flood = self.pipes[:self.flood]
        for at, pipe in enumerate(flood):
            pipe.send(("closed", (clients + at) // self.flood, seconds, pick, seed + at))
        limit = seconds + CLIENT_TIMEOUT_S + REPLY_MARGIN_S
        return sum(await asyncio.gather(*(asyncio.to_thread(_received, pipe, limit) for pipe in flood)))

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:   # the process is gone already
                pass
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> "ClientProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _received(pipe, timeout_s: float):
    """The process's next answer; its failure raised here, in the benchmark."""
    if not pipe.poll(timeout_s):
        raise RuntimeError(f"a client process did not answer within {timeout_s:g} s")
    try:
        answer = pipe.recv()
    except EOFError:
        raise RuntimeError("a client process exited") from None
    if isinstance(answer, BaseException):
        raise RuntimeError(f"a client process failed: {answer!r}")
    return answer


def _outcomes(share: dict, at: np.ndarray, priority: np.ndarray, start: float) -> list[Outcome]:
    """One process's arrays as outcomes; an unanswered request's time is the client's timeout."""
    due = start + at
    answered = ~np.isnan(share["replied"])
    seconds = np.where(answered, share["replied"], share["sent"] + CLIENT_TIMEOUT_S) - due
    return [Outcome(PRIORITIES[p], share["codes"][o], float(s), bool(c), float(a), float(sent), share["first_id"] + k)
            for k, (p, o, s, c, a, sent) in enumerate(zip(priority, share["outcome"], seconds, share["cached"], at,
                                                          share["sent"] - start))]


def _client_main(pipe, make_sender, prepare: int, first_id: int, nice: int) -> None:
    try:
        _serve(pipe, make_sender, prepare, first_id, nice)
    except Exception as e:   # noqa: BLE001 - reported to the benchmark, which raises it
        pipe.send(RuntimeError(f"{type(e).__name__}: {e}"))


def _serve(pipe, make_sender, prepare: int, first_id: int, nice: int) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, nice)   # before the sender's threads start: they inherit it
    sender = make_sender(first_id=first_id)
    sender.prepare(prepare)
    sender.connect()
    try:
        first = sender.open_loop(np.zeros(1), np.full(1, WARM_INDEX), np.zeros(1, np.int8), time.monotonic(),
                                 CLIENT_TIMEOUT_S)
        if first["outcome"][0] != OK:
            raise RuntimeError(f"the first request was answered {first['codes'][first['outcome'][0]]}")
        pipe.send("ready")
        while (job := pipe.recv()) is not None:
            kind, *args = job
            run = sender.open_loop if kind == "open" else sender.closed_loop
            pipe.send(run(*args, CLIENT_TIMEOUT_S))
    finally:
        sender.close()
