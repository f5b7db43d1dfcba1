"""The number of threads a CPU worker's steps run fastest on, found while it serves.

One thread per core the worker owns is right on an idle machine. When another process takes one
of those cores, the thread sharing it falls behind and every parallel region waits for it: on a
2-core machine with one core busy, one thread decoded faster than two (bench/engine.py,
contention). Nothing tells a process that a neighbour started, so the tuner tries: every
PERIOD steps it runs TRIAL steps on one thread more or fewer (alternately, within 1 ..
most) and keeps the count whose steps were at least GAIN faster. Steps are compared only with
steps that computed the same number of tokens (a decode batch that did not change), so a new
request mid-trial voids the trial instead of deciding it. A trial costs at most TRIAL slow
steps per PERIOD: about 3% of the steps, slower only while the other count is the worse one.
"""
from __future__ import annotations

from collections.abc import Callable

PERIOD = 128   # steps between trials: a neighbour is noticed within about half a second of decoding
TRIAL = 4      # steps per trial, and steps of the current count it is compared with
GAIN = 0.9     # a trial wins when its mean step time is below this share of the current one
# An engine idle this long starts again on every thread: what a neighbour did before the pause
# says nothing about now. Before this, a worker that had dropped to one thread while a neighbour
# ran kept it into the next burst until a trial 128 steps later, so the burst's first prefill ran
# on one core.
IDLE_RESET_S = 1.0


class ThreadTuner:
    def __init__(self, most: int, set_threads: Callable[[int], None]) -> None:
        self.most, self.set_threads = most, set_threads
        self.current = most
        self.trying: int | None = None          # the count on trial, if one runs
        self.baseline: list[tuple[int, float]] = []   # (tokens, seconds) of recent steps at current
        self.trial: list[tuple[int, float]] = []
        self.steps = 0
        self.downward = True                    # the direction of the next trial

    def resume(self, idle_seconds: float) -> None:
        """A step is about to run, idle_seconds after the previous one ended. After a pause the
        burst starts on every thread and tries one fewer as soon as its decode steps can be compared,
        not PERIOD steps later: a neighbour that came during the pause costs a few steps, not a
        whole 128-token answer (bench/peers.py W1 with one core busy: keep 0.64 before)."""
        if idle_seconds < IDLE_RESET_S:
            return
        if self.current != self.most or self.trying is not None:
            self.set_threads(self.most)
        self.current, self.trying, self.baseline, self.trial = self.most, None, [], []
        # the trial starts after TRIAL + 1 steps: the burst's first is a prefill, like no step after it
        self.steps, self.downward = PERIOD - TRIAL - 1, True

    @property
    def measuring(self) -> bool:
        """Whether the coming steps are a trial's or the ones it is compared with. The engine then
        runs plain steps, not bursts (Engine._burst_length): a trial is decided in TRIAL steps, and
        bursts would stretch those to ~TRIAL bursts' tokens (a W1 request after a pause ran its
        first ~45 tokens on both threads beside a busy neighbour: busy W1 103-115 tok/s, against
        142-184 on one thread), and mix bursts and single steps, whose tokens cost apart."""
        return self.most > 1 and (self.trying is not None or self.steps % PERIOD >= PERIOD - TRIAL - 1)

    def skip(self, steps: int) -> None:
        """A burst of `steps` decode steps ran (Engine._run_burst): they bring the next trial
        nearer as that many steps would, up to the steps that measure it, and are compared with
        nothing. Counted by calls, a trial came every 128 bursts (~650 tokens), and one lost to a
        noisy baseline cost a whole W1 answer on the wrong thread count."""
        window = self.steps - self.steps % PERIOD + PERIOD - TRIAL - 1
        self.steps = min(self.steps + steps, window)

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` tokens took `seconds`."""
        self.steps += 1
        if self.trying is None:
            self.baseline = (self.baseline + [(tokens, seconds)])[-TRIAL:]
            if self.steps % PERIOD == 0 and self.most > 1:
                self._start_trial()
            return
        self.trial.append((tokens, seconds))
        if len(self.trial) == TRIAL:
            self._decide()

    def _start_trial(self) -> None:
        candidate = self.current - 1 if self.downward else self.current + 1
        if not 1 <= candidate <= self.most:
            candidate = self.current + 1 if self.downward else self.current - 1
        self.downward = not self.downward
        self.trying, self.trial = candidate, []
        self.set_threads(candidate)

    def _decide(self) -> None:
        shapes = {tokens for tokens, _ in self.baseline + self.trial}
        comparable = len(self.baseline) == TRIAL and len(shapes) == 1
        if comparable and _mean(self.trial) < GAIN * _mean(self.baseline):
            self.current, self.baseline = self.trying, self.trial
        else:
            self.set_threads(self.current)
        self.trying = None


def _mean(steps: list[tuple[int, float]]) -> float:
    return sum(seconds for _, seconds in steps) / len(steps)
