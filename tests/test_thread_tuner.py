"""The thread tuner's choices, from step times fed to it (no clock: the same every run)."""
from mcpd.cpu.thread_tuner import PERIOD, RETRY, SPARE, TRIAL, WINDOW_S, ThreadTuner


def serve(tuner: ThreadTuner, seconds_at, steps: int, tokens=lambda step: 4) -> list[int]:
    """Feed `steps` steps whose time depends on the tuner's thread count; return the counts set."""
    set_to = []
    tuner.set_threads = set_to.append
    threads = tuner.current
    for step in range(steps):
        tuner.observe(tokens(step), seconds_at(threads))
        threads = set_to[-1] if set_to else threads
    return set_to


def test_fewer_threads_are_kept_when_they_run_faster():
    tuner = ThreadTuner(2, None)
    serve(tuner, {1: 0.010, 2: 0.015}.get, PERIOD + TRIAL)
    assert tuner.current == 1
    serve(tuner, {1: 0.010, 2: 0.004}.get, 2 * PERIOD + TRIAL)   # the core is free again
    assert tuner.current == 2


def test_a_faster_count_must_win_by_ten_percent():
    tuner = ThreadTuner(4, None)
    set_to = serve(tuner, {3: 0.0095, 4: 0.010}.get, 4 * PERIOD)
    assert tuner.current == 4 and set_to[:2] == [3, 4]   # tried, and went back


def test_a_batch_that_changes_during_a_trial_decides_nothing():
    tuner = ThreadTuner(2, None)
    serve(tuner, {1: 0.001, 2: 0.015}.get, PERIOD + TRIAL, tokens=lambda step: 4 + (step >= PERIOD + 2))
    assert tuner.current == 2 and tuner.trying is None


def test_a_voided_trial_is_not_a_lost_one_waits_bring_the_next_at_once():
    """A periodic trial that began at a burst's end, voided by the next burst's prefill: the waits
    of a neighbour that came meanwhile bring a trial within a few steps, not 2 * RETRY later."""
    waits = iter([0.0] * (PERIOD + 1) + [0.5] * 1000)
    tuner = ThreadTuner(2, None, lambda: next(waits))
    serve(tuner, {1: 0.010, 2: 0.015}.get, PERIOD + 1)
    assert tuner.trying == 1 and tuner.retry == RETRY
    # the next burst: a prefill, then decode steps beside the neighbour
    set_to = serve(tuner, {1: 0.010, 2: 0.015}.get, 4 * TRIAL, tokens=lambda step: 1024 if step == 0 else 8)
    assert set_to == [2, 1] and tuner.current == 1 and tuner.retry == RETRY


def test_a_pause_ends_a_trial_under_way_and_the_next_burst_runs_on_the_count_that_won():
    tuner = ThreadTuner(2, None)
    set_to = serve(tuner, {1: 0.010, 2: 0.008}.get, PERIOD + 1)   # a periodic trial of one thread began
    assert tuner.trying == 1 and set_to == [1]
    tuner.resume(0.01)   # between steps of one burst: the trial goes on
    assert tuner.trying == 1 and set_to == [1]
    tuner.resume(0.3)    # the work stopped: the next burst's prefill runs on both threads
    assert tuner.trying is None and tuner.current == 2 and set_to == [1, 2] and tuner.retry == RETRY


def test_voided_trials_in_a_row_back_off_as_lost_ones_do():
    """A batch that changes at every step (W4's one-token requests) voids every trial: after the
    first, each doubles the gap before waits may bring the next, up to PERIOD."""
    tuner = ThreadTuner(2, None, lambda: 0.5)
    started, step = [], 0
    tuner.set_threads = lambda count: started.append(step) if count == 1 else None
    for step in range(8 * PERIOD):
        tuner.observe(1 + step % 3, {1: 0.010, 2: 0.010}[tuner.trying or tuner.current])
    between = [later - earlier for earlier, later in zip(started, started[1:])]
    assert tuner.current == 2 and between[-3:] == [PERIOD] * 3 and len(started) < 8 * PERIOD // RETRY


def test_one_thread_is_never_tuned():
    tuner = ThreadTuner(1, None)
    assert serve(tuner, lambda threads: 0.01, 3 * PERIOD) == []


def test_after_a_pause_the_next_burst_starts_on_every_thread():
    tuner = ThreadTuner(2, None)
    serve(tuner, {1: 0.010, 2: 0.015}.get, PERIOD + TRIAL)   # a neighbour took a core
    assert tuner.current == 1
    set_to = []
    tuner.set_threads = set_to.append
    tuner.resume(0.05)   # between steps of one burst: nothing changes
    assert tuner.current == 1 and set_to == []
    tuner.resume(5.0)    # idle for seconds: the neighbour may be gone
    assert tuner.current == 2 and set_to == [2]
    tuner.resume(5.0)    # already on every thread: nothing to set
    assert set_to == [2]


def test_after_a_pause_a_neighbour_is_found_within_a_few_steps():
    tuner = ThreadTuner(2, None)
    tuner.resume(5.0)
    # the neighbour came during the pause; the burst's first step is a prefill
    serve(tuner, {1: 0.010, 2: 0.015}.get, 2 * TRIAL + 1, tokens=lambda step: 128 if step == 0 else 1)
    assert tuner.current == 1


def test_bursts_bring_the_next_trial_nearer_and_are_never_measured():
    """Engine._run_burst: a burst counts as its steps towards the next trial (skip), but stops
    short of the steps a trial compares (measuring), which the engine then runs one by one."""
    tuner = ThreadTuner(2, None)
    set_to = []
    tuner.set_threads = set_to.append
    assert not tuner.measuring
    skipped = 0
    while not tuner.measuring:   # bursts of 7 tokens, as an engine would run them
        tuner.skip(7)
        skipped += 7
    assert skipped >= PERIOD - TRIAL - 1 and tuner.steps == PERIOD - TRIAL - 1 and set_to == []
    for _ in range(TRIAL + 1):   # the steps compared with the trial, then the first that tries
        tuner.observe(1, 0.015)
    assert set_to == [1] and tuner.measuring
    for _ in range(TRIAL):
        tuner.observe(1, 0.010)
    assert tuner.current == 1 and not tuner.measuring


def test_after_a_pause_the_tuner_measures_before_any_burst():
    tuner = ThreadTuner(2, lambda count: None)
    tuner.resume(idle_seconds=5.0)
    assert tuner.measuring
    assert not ThreadTuner(1, None).measuring   # one thread: nothing to measure


def test_a_neighbour_seen_waiting_brings_the_next_trial_to_now():
    """Run-delay says a team thread waits for its core (RunDelay.share) at two steps in a row:
    the downward trial is measured from the next step, not at the periodic one, PERIOD steps
    later. One such step alone (W4's clients make a few) does not."""
    waits = iter([0.0] * 10 + [0.5] + [0.0] * 10 + [0.5] * 1000)
    tuner = ThreadTuner(2, None, lambda: next(waits))
    serve(tuner, {1: 0.010, 2: 0.015}.get, 21)
    assert tuner.current == 2 and not tuner.measuring
    set_to = serve(tuner, {1: 0.010, 2: 0.015}.get, 2 * TRIAL + 3)
    assert set_to == [1] and tuner.current == 1


def test_without_waits_the_trial_keeps_its_period():
    tuner = ThreadTuner(2, None, lambda: 0.01)
    set_to = serve(tuner, {1: 0.010, 2: 0.015}.get, PERIOD - 1)
    assert set_to == [] and tuner.current == 2


def test_waits_fewer_threads_do_not_cure_bring_trials_ever_more_rarely():
    """The daemon's own processes wait for the cores too, and one thread fewer is slower then:
    each lost trial doubles the steps before waits may bring the next, up to PERIOD."""
    tuner = ThreadTuner(2, None, lambda: 0.5)
    started, step = [], 0   # the steps trials of one thread started at
    tuner.set_threads = lambda count: started.append(step) if count == 1 else None
    for step in range(6 * PERIOD):
        tuner.observe(1, {1: 0.015, 2: 0.010}[tuner.trying or tuner.current])
    assert tuner.current == 2
    assert started[0] == TRIAL + 2   # the first two steps saw the waits; then the baseline's steps
    # From one trial's start to the next: its TRIAL steps, the gap (RETRY doubled by the lost
    # trial), the next baseline's TRIAL + 1. Then every PERIOD steps, as if nobody waited.
    between = [later - earlier for earlier, later in zip(started, started[1:])]
    assert between == [TRIAL + 2 * RETRY + TRIAL + 1] + [PERIOD] * (len(between) - 1) and len(between) >= 4


def test_a_won_trial_or_a_pause_lets_waits_bring_the_next_soon_again():
    tuner = ThreadTuner(2, None, lambda: 0.5)
    serve(tuner, {1: 0.015, 2: 0.010}.get, PERIOD)   # trials lost: the gap grew
    assert tuner.retry > RETRY
    tuner.resume(5.0)
    assert tuner.retry == RETRY
    serve(tuner, {1: 0.015, 2: 0.010}.get, PERIOD)
    assert tuner.retry > RETRY and tuner.current == 2
    serve(tuner, {1: 0.010, 2: 0.015}.get, PERIOD + 2 * TRIAL + 2)   # now one thread is faster: a trial won
    assert tuner.current == 1 and tuner.retry == RETRY


def test_waits_during_bursts_end_the_bursts_for_a_trial():
    """Engine._run_burst reports bursts with skip(): waits seen over a burst make the next steps
    the trial's (measuring), which the engine runs one by one."""
    tuner = ThreadTuner(2, None, lambda: 0.5)
    tuner.steps = RETRY   # well before the periodic trial, long after the last
    tuner.skip(7)
    assert not tuner.measuring   # one burst's waits: not yet
    tuner.skip(7)
    assert tuner.measuring and tuner.trying is None


def test_after_a_pause_waits_decide_whether_a_trial_comes_soon():
    """With waits to read, a pause brings no trial of its own (it cost an idle W1 ~8% on fast
    memory); waits seen after it bring one within a few steps."""
    quiet = ThreadTuner(2, None, lambda: 0.01)
    quiet.resume(5.0)
    assert serve(quiet, {1: 0.020, 2: 0.010}.get, PERIOD - 1, tokens=lambda step: 128 if step == 0 else 1) == []
    busy = ThreadTuner(2, None, lambda: 0.5)
    busy.resume(5.0)
    set_to = serve(busy, {1: 0.010, 2: 0.015}.get, 2 * TRIAL + 3, tokens=lambda step: 128 if step == 0 else 1)
    assert set_to == [1] and busy.current == 1


def test_a_trial_that_waits_brought_wins_by_any_margin_a_periodic_one_by_ten_percent():
    """Beside a neighbour the steps vary a lot, and the waits are evidence of their own: one
    thread fewer is kept when its steps are faster at all. Without waits, the margin stays."""
    slightly = {1: 0.0145, 2: 0.015}.get
    tuner = ThreadTuner(2, None, lambda: 0.5)
    assert serve(tuner, slightly, 2 * TRIAL + 3) == [1] and tuner.current == 1
    tuner = ThreadTuner(2, None, lambda: 0.0)
    assert serve(tuner, slightly, PERIOD + TRIAL) == [1, 2] and tuner.current == 2


def test_one_slow_step_does_not_decide_a_trial():
    """Medians, not means: a trial step the kernel held back (0.030 among 0.010s; the mean would
    be 0.015, no faster than two threads') does not lose the trial."""
    tuner = ThreadTuner(2, None)
    set_to = []
    tuner.set_threads = set_to.append
    for step in range(PERIOD + TRIAL):
        trial_step = step - PERIOD
        seconds = 0.015 if tuner.trying is None else (0.030 if trial_step == 2 else 0.010)
        tuner.observe(4, seconds)
    assert set_to == [1] and tuner.current == 1


def test_the_first_reading_after_a_pause_covers_the_first_step_not_the_pause():
    """A reading is the share of the time since the previous one that a thread waited: read over
    a pause it comes out near 0 whatever the first step met. The pause's end takes a reading, so
    a neighbour met by the first two steps brings the trial after those two."""
    waits = iter([0.0] + [0.5] * 100)   # the reading over the pause, then every step's
    tuner = ThreadTuner(2, None, lambda: next(waits))
    tuner.resume(5.0)
    serve(tuner, {1: 0.010, 2: 0.015}.get, 2, tokens=lambda step: 128 if step == 0 else 1)
    assert tuner.measuring


class ScriptedCores:
    """Idle readings of a worker's cores, as IdleCores.since() gives them: each call covers one
    step of `step_s` during which `idle` cores sat idle (a list: one value per call, then the last)."""

    def __init__(self, cpus: int, idle: list[float], step_s: float = 0.010):
        self.cpus, self.idle, self.step_s, self.calls = cpus, idle, step_s, 0

    def since(self) -> tuple[float, float]:
        idle = self.idle[min(self.calls, len(self.idle) - 1)]
        self.calls += 1
        return idle * self.step_s, self.step_s


def on_one_thread(cores: ScriptedCores) -> ThreadTuner:
    """A 2-thread tuner that went to one thread beside a neighbour (at its periodic trial; its
    team's waits read nothing, so no trial follows a return to every thread)."""
    tuner = ThreadTuner(2, None, lambda: 0.0, cores)
    serve(tuner, {1: 0.010, 2: 0.015}.get, PERIOD + TRIAL)
    assert tuner.current == 1
    return tuner


def test_the_core_left_unused_sitting_idle_puts_the_team_back_on_every_thread():
    """The neighbour left mid-stream: the core the team left to it sits idle for WINDOW_S, and
    the next step runs on both threads, no trial (bench/peers.py --quick's W2-32 after the busy
    W2-8 ran its prefill and 35 steps on one thread before)."""
    cores = ScriptedCores(2, [0.0])
    tuner = on_one_thread(cores)
    set_to = serve(tuner, {1: 0.010, 2: 0.006}.get, 2 * TRIAL)   # the neighbour is still there
    assert tuner.current == 1 and set_to == []
    cores.idle = [0.9]   # gone; the daemon's own processes use a little of the core
    # within two windows: the one under way when it left may be judged busy
    set_to = serve(tuner, {1: 0.010, 2: 0.006}.get, 2 * round(WINDOW_S / cores.step_s) + 3)
    assert set_to == [2] and tuner.current == 2 and tuner.trying is None


def test_a_core_half_busy_is_not_a_core_freed():
    cores = ScriptedCores(2, [SPARE * 0.8])
    tuner = on_one_thread(cores)
    assert serve(tuner, {1: 0.010, 2: 0.006}.get, 4 * round(WINDOW_S / cores.step_s)) == []


def test_the_cores_are_read_only_on_fewer_threads_than_cores():
    """/proc/stat costs a read a step: none while the team runs on every thread."""
    cores = ScriptedCores(2, [1.0])
    tuner = ThreadTuner(2, None, lambda: 0.0, cores)
    serve(tuner, {1: 0.015, 2: 0.010}.get, PERIOD - TRIAL - 1)
    assert cores.calls == 0


def test_a_pause_with_every_core_idle_starts_the_next_burst_on_every_thread():
    """Shorter than IDLE_RESET_S, but every core sat idle during it: no neighbour now. With one
    core busy during the pause (the neighbour), the team stays on one thread."""
    cores = ScriptedCores(2, [0.0])
    tuner = on_one_thread(cores)
    set_to = []
    tuner.set_threads = set_to.append
    cores.idle, cores.step_s = [1.0], 0.3   # the neighbour's core busy all through the pause
    tuner.resume(0.3)
    assert tuner.current == 1 and set_to == []
    tuner.observe(4, 0.010)
    cores.idle = [2.0]                      # both cores idle all through the pause
    tuner.resume(0.3)
    assert tuner.current == 2 and set_to == [2]


def test_a_cap_drops_the_team_to_it_at_once_and_trials_stay_within_it():
    tuner = ThreadTuner(2, None)
    set_to = []
    tuner.set_threads = set_to.append
    tuner.cap(1)
    assert set_to == [1] and tuner.current == 1 and not tuner.measuring
    assert serve(tuner, {1: 0.010, 2: 0.001}.get, 3 * PERIOD) == []   # two would be faster: never tried
    set_to = []
    tuner.set_threads = set_to.append
    tuner.cap(2)
    assert set_to == [2] and tuner.current == 2


def test_a_cap_ends_a_trial_under_way_and_lifting_it_starts_over_on_every_thread():
    tuner = ThreadTuner(4, None)
    serve(tuner, {3: 0.010, 4: 0.010}.get, PERIOD + 1)
    assert tuner.trying == 3
    set_to = []
    tuner.set_threads = set_to.append
    tuner.cap(2)
    assert set_to == [2] and (tuner.current, tuner.trying) == (2, None)
    tuner.cap(4)
    assert set_to == [2, 4] and tuner.current == 4
