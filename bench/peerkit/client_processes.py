"""Client processes that offer one open-loop schedule together, for rates one Python process
cannot send on time (a burst at twice a fast server's capacity): each process has its own event
loop and its own target (its own sockets), and sends every n-th arrival of the schedule at the
same start; their outcomes are merged. Each outcome keeps its lag, so a run where the processes
still fall behind shows in generator_figures (load.py) instead of passing for server latency.

Processes start with `spawn` (a forked copy of a ZeroMQ context is not safe), once, and serve
every schedule handed to them until closed."""
from __future__ import annotations

import asyncio
import multiprocessing

from peerkit.load import CLIENT_TIMEOUT_S, Outcome, arrivals, clock, closed_loop, send_on_schedule

START_LEAD_S = 0.5     # a schedule starts this long after it is handed out: every process has it by then
READY_TIMEOUT_S = 120  # a process imports numpy, zmq and mcpd, and encodes its inputs, before it is ready
WARM_INDEX = 0         # each process's first request, before it is ready: its socket is connected then
REPLY_MARGIN_S = 60    # past the schedule's end and the last reply's timeout: the process is stuck


class ClientProcesses:
    """`count` processes, each sending through `make_target()` (picklable: built in the process)
    after encoding inputs 0..prepare-1."""

    def __init__(self, make_target, count: int, prepare: int):
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for _ in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_client_main, args=(theirs, make_target, prepare), daemon=True)
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)
        for pipe in self.pipes:
            _received(pipe, READY_TIMEOUT_S)

    async def open_loop(self, rate: float, seconds: float, pick, seed: int, high_frac: float = 0.0) -> list[Outcome]:
        """load.open_loop's schedule, every process sending its share; outcomes in schedule order."""
        schedule = arrivals(rate, seconds, pick, seed, high_frac)
        start = clock() + START_LEAD_S
        count = len(self.pipes)
        for at, pipe in enumerate(self.pipes):
            pipe.send(("open", schedule[at::count], start))
        limit = START_LEAD_S + seconds + CLIENT_TIMEOUT_S + REPLY_MARGIN_S
        shares = await asyncio.gather(*(asyncio.to_thread(_received, pipe, limit) for pipe in self.pipes))
        return sorted((outcome for share in shares for outcome in share), key=lambda o: o.scheduled_s)

    async def closed_loop(self, clients: int, seconds: float, pick, seed: int) -> float:
        """load.closed_loop's requests/s with `clients` spread over the processes, summed: the
        capacity of a server one process's clients cannot saturate. `pick` must pickle."""
        count = len(self.pipes)
        for at, pipe in enumerate(self.pipes):
            pipe.send(("closed", (clients + at) // count, seconds, pick, seed + at))
        limit = seconds + CLIENT_TIMEOUT_S + REPLY_MARGIN_S
        return sum(await asyncio.gather(*(asyncio.to_thread(_received, pipe, limit) for pipe in self.pipes)))

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


def _client_main(pipe, make_target, prepare: int) -> None:
    try:
        asyncio.run(_serve(pipe, make_target, prepare))
    except Exception as e:   # noqa: BLE001 - reported to the benchmark, which raises it
        pipe.send(RuntimeError(f"{type(e).__name__}: {e}"))


async def _serve(pipe, make_target, prepare: int) -> None:
    target = make_target()
    target.prepare(prepare)
    await target.infer(WARM_INDEX, "normal")
    pipe.send("ready")
    try:
        while (job := await asyncio.to_thread(pipe.recv)) is not None:
            kind, *args = job
            pipe.send(await (send_on_schedule if kind == "open" else closed_loop)(target, *args))
    finally:
        await target.close()
