"""The number of threads a CPU worker's steps run fastest on, found while it serves.

One thread per core the worker owns is right on an idle machine. When another process takes one
of those cores, the thread sharing it falls behind and every parallel region waits for it: on a
2-core machine with one core busy, one thread can decode faster than two (bench/engine.py,
contention). Whether fewer threads are faster is for a trial to say: every PERIOD steps the tuner
runs TRIAL steps on one thread more or fewer (alternately, within 1 .. most) and keeps the count
whose median step was at least GAIN faster (faster at all for a trial that waits brought,
below). Steps are compared only with steps that computed the same number of tokens (a decode
batch that did not change), so a new request mid-trial voids the trial instead of deciding it.
A trial costs at most TRIAL slow steps per PERIOD: about 3% of the steps, slower only while the
other count is the worse one.

When a neighbour comes is for Linux to say: a team thread that waits for a CPU a CONTENDED share
of the time (run_delay.py), twice in a row, brings the next trial, a downward one, to now, so
a neighbour that comes mid-stream costs a few steps on the wrong count, not up to PERIOD.
When it leaves is for Linux to say too: on fewer threads than cores, the cores the team leaves
unused sitting idle for WINDOW_S, or every core sitting idle during a pause between bursts, put
the team back on every thread at once (idle_cores.py), as on an idle machine: no trial, whose
steps must match in shape, and a burst that starts with prefills has none to compare for a while.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from mcpd.cpu.idle_cores import IdleCores

PERIOD = 128   # steps between trials: a neighbour is noticed within about half a second of decoding
TRIAL = 4      # steps per trial, and steps of the current count it is compared with
GAIN = 0.9     # a trial wins when its median step time is below this share of the current one
# A downward trial that waits brought (see below) wins when its median step is faster at all: the
# waits are evidence of their own, and steps beside a neighbour vary so much that GAIN's margin
# would lose such trials to noise.
CONTENDED_GAIN = 1.0
# An engine idle this long starts again on every thread: what a neighbour did before the pause
# says nothing about now, and the next burst's first prefill should not run on fewer cores.
IDLE_RESET_S = 1.0
# A team thread waited this share of the time for a CPU, at two readings in a row: a neighbour is on
# its core. Beside a spinning neighbour a typical reading is above it; in idle serving one reading
# over it comes now and then, two in a row seldom.
CONTENDED = 0.3
# Steps from the end of a trial before contention may start the next. Waits need not mean fewer
# threads are faster: the daemon's own processes and its clients wait for the cores too, and
# would bring a lost trial every RETRY steps. So each lost trial doubles the gap, up to PERIOD,
# and a won one or a pause sets it back to RETRY.
RETRY = 32
# A pause between steps this long ends a trial under way (resume), so that the next burst's
# prefill does not run on the trial's fewer threads. Steps of one burst follow each other within
# milliseconds; a pause of this length is the work stopping.
TRIAL_PAUSE_S = 0.1
# On fewer threads than cores, the idle time of the cores is read at every step and judged over
# this long (/proc/stat counts in 10 ms ticks: ten a core). The cores the team leaves unused count
# as free when at most SPARE of a core of them was busy: the daemon's own processes and its
# clients use a little.
WINDOW_S = 0.1
SPARE = 0.5


class ThreadTuner:
    def __init__(self, most: int, set_threads: Callable[[int], None],
                 waited: Callable[[], float] | None = None, idle: IdleCores | None = None) -> None:
        """waited: the largest share of the time since its previous call that a team thread
        waited for a CPU (RunDelay.share); idle: the idle time of the cores the worker may run on
        (IdleCores); each None where it cannot be known."""
        self.most, self.set_threads, self.waited, self.idle = most, set_threads, waited, idle
        self.limit = most                       # the most threads it may use now (cap)
        self.current = most
        self.trying: int | None = None          # the count on trial, if one runs
        self.baseline: list[tuple[int, float]] = []   # (tokens, seconds) of recent steps at current
        self.trial: list[tuple[int, float]] = []
        self.steps = 0
        self.trial_ended = -RETRY               # the step the last trial was decided at
        self.waited_before = False              # whether the previous reading was CONTENDED too
        self.retry = RETRY                      # steps from then before contention may start one
        self.downward = True                    # the direction of the next trial
        self.brought = False                    # whether waits brought the trial to be decided next
        self.voided = False                     # whether the last trial was void (its batch changed)
        self.idle_window: tuple[float, float] | None = None   # idle core-seconds, seconds: read on fewer threads

    def resume(self, idle_seconds: float) -> None:
        """A step is about to run, idle_seconds after the previous one ended. After a pause the
        burst starts on every thread. Where waits are seen (`waited`), a neighbour that came during
        the pause brings a trial within a few steps, and none runs otherwise: on fast memory one
        thread streams half of what two do, so a trial after every pause would slow an idle
        engine. Blind, the burst tries one fewer as soon as its decode steps can be compared, not
        PERIOD steps later: a neighbour that came during the pause costs a few steps, not a whole
        answer. A shorter pause ends a trial under way, void: the
        next burst's first steps run on the count that won, not on the count on trial. A shorter
        pause during which every core sat idle (no neighbour now) starts the burst on every
        thread too."""
        if idle_seconds >= IDLE_RESET_S or self._cores_idle_over(idle_seconds):
            self._start_over()
        elif idle_seconds >= TRIAL_PAUSE_S and self.trying is not None:
            self._void()

    def cap(self, limit: int) -> None:
        """Use at most `limit` threads from now on (1 .. most). Lowered, the team drops to it at
        once and trials stay within it; raised back to `most`, the team starts over on every
        thread, as after a pause."""
        limit = max(1, min(limit, self.most))
        if limit == self.limit:
            return
        self.limit = limit
        if limit == self.most:
            return self._start_over()
        if self.current > limit or self.trying is not None:
            self.set_threads(min(self.current, limit))
        self.current, self.trying, self.baseline, self.trial = min(self.current, limit), None, [], []
        self.idle_window = None

    def _start_over(self) -> None:
        """Every thread it may use, as on an idle machine: what a neighbour did before says nothing about now."""
        if self.current != self.limit or self.trying is not None:
            self.set_threads(self.limit)
        self.current, self.trying, self.baseline, self.trial = self.limit, None, [], []
        # blind, the trial starts after TRIAL + 1 steps: the burst's first is a prefill, like no step after it
        self.steps = 0 if self.waited is not None else PERIOD - TRIAL - 1
        self.trial_ended, self.retry, self.downward, self.waited_before = -RETRY, RETRY, True, False
        self.brought = self.voided = False
        self.idle_window = None
        if self.waited is not None:
            # A reading covers the time since the last: read now, so that the pause's idle time
            # does not dilute the burst's first step's waits below CONTENDED.
            self.waited()

    @property
    def measuring(self) -> bool:
        """Whether the coming steps are a trial's or the ones it is compared with. The engine then
        runs plain steps, not bursts (Engine._burst_length): a trial is decided in TRIAL steps, and
        bursts would stretch those to ~TRIAL bursts' tokens, all on a count that may be the wrong
        one, and mix bursts and single steps, whose tokens cost apart."""
        return self.limit > 1 and (self.trying is not None or self.steps % PERIOD >= PERIOD - TRIAL - 1)

    def skip(self, steps: int) -> None:
        """A burst of `steps` decode steps ran (Engine._run_burst): they bring the next trial
        nearer as that many steps would, up to the steps that measure it, and are compared with
        nothing. Counted by calls, a trial would come only every PERIOD bursts, and one lost to a
        noisy baseline would leave a whole answer on the wrong thread count."""
        self.steps = min(self.steps + steps, self._window())
        contended = self._contended()
        if self._cores_freed():
            self._start_over()
        elif contended:
            self._bring_trial_forward()

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` tokens took `seconds`."""
        self.steps += 1
        contended = self._contended()   # read at every step: each reading covers one step's time
        if self._cores_freed():
            return self._start_over()
        if self.trying is None:
            self.baseline = (self.baseline + [(tokens, seconds)])[-TRIAL:]
            if self.steps % PERIOD == 0 and self.limit > 1:
                self._start_trial()
            elif contended:
                self._bring_trial_forward()
            return
        self.trial.append((tokens, seconds))
        if len(self.trial) == TRIAL:
            self._decide()

    def _window(self) -> int:
        """The step the steps that measure the next trial begin at (a trial's baseline)."""
        return self.steps - self.steps % PERIOD + PERIOD - TRIAL - 1

    def _contended(self) -> bool:
        if self.waited is None:
            return False
        waited, self.waited_before = self.waited_before, self.waited() >= CONTENDED
        return waited and self.waited_before

    def _cores_freed(self) -> bool:
        """Whether, on fewer threads than cores, the cores the team leaves unused sat idle over
        the last WINDOW_S: the neighbour left. Read at every step then (a pause is judged from
        the last step's end), but a trial's steps (another thread count) and the first reading
        only start the window."""
        if self.idle is None or self.current == self.limit:
            self.idle_window = None
            return False
        idle, seconds = self.idle.since()
        if self.idle_window is None or self.trying is not None:
            self.idle_window = (0.0, 0.0)
            return False
        idle, seconds = idle + self.idle_window[0], seconds + self.idle_window[1]
        if seconds < WINDOW_S:
            self.idle_window = (idle, seconds)
            return False
        self.idle_window = (0.0, 0.0)
        return idle >= (self.idle.cpus - self.current - SPARE) * seconds

    def _cores_idle_over(self, pause_seconds: float) -> bool:
        """Whether every core sat idle during a pause of at least TRIAL_PAUSE_S, on fewer threads
        than cores (read since the last step's end: the window is read at every step then)."""
        if pause_seconds < TRIAL_PAUSE_S or self.idle_window is None:
            return False
        idle, seconds = self.idle.since()
        self.idle_window = (0.0, 0.0)
        return idle >= (self.idle.cpus - SPARE) * seconds

    def _bring_trial_forward(self) -> None:
        """A team thread waited for its core: measure a trial of one thread fewer from the next
        step on, unless one is measured already, no fewer can run, or the last ended too lately."""
        if (self.trying is not None or self.current == 1 or self.measuring
                or self.steps - self.trial_ended < self.retry):
            return
        self.steps, self.downward, self.brought = self._window(), True, True

    def _start_trial(self) -> None:
        candidate = self.current - 1 if self.downward else self.current + 1
        if not 1 <= candidate <= self.limit:
            candidate = self.current + 1 if self.downward else self.current - 1
        self.downward = not self.downward
        self.trying, self.trial = candidate, []
        self.set_threads(candidate)

    def _decide(self) -> None:
        shapes = {tokens for tokens, _ in self.baseline + self.trial}
        if len(self.baseline) < TRIAL or len(shapes) > 1:
            self._void()
            return
        gain = CONTENDED_GAIN if self.brought else GAIN
        if _median(self.trial) < gain * _median(self.baseline):
            self.current, self.baseline, self.retry = self.trying, self.trial, RETRY
        else:
            self.set_threads(self.current)
            self.retry = min(2 * self.retry, PERIOD)
        self.trying, self.trial_ended, self.brought, self.voided = None, self.steps, False, False

    def _void(self) -> None:
        """End the trial undecided (its batch changed, or a pause came): back to the current count.
        The first void in a row is not a lost trial, so the next waits may bring one at once:
        counted as lost, a trial that a burst's end started and the next burst's prefill voided
        would hold the contention trial off for 2 * RETRY steps of the new burst. Voids in a row
        (a batch that changes at every step) back off as lost trials do."""
        self.set_threads(self.current)
        if self.voided:
            self.retry, self.trial_ended = min(2 * self.retry, PERIOD), self.steps
        self.trying, self.trial, self.brought, self.voided = None, [], False, True


def _median(steps: list[tuple[int, float]]) -> float:
    """The median step time: one step the kernel held back (or the neighbour left alone) does not decide."""
    return statistics.median(seconds for _, seconds in steps)
