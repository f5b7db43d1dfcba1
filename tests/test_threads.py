"""A CPU worker's threads: how many, on which cores, and OpenMP's wait policy set before torch loads."""
import subprocess
import sys

import pytest

from mcpd.cpu import threads
from mcpd.cpu.threads import plan


@pytest.mark.parametrize("cores, workers, index, requested, expected", [
    ([0, 1], 1, 0, 0, ([0, 1], 2)),                  # one worker: every core
    ([0, 1, 2, 3], 2, 1, 0, ([2, 3], 2)),            # two workers split four cores
    ([0, 1, 2, 3, 4], 2, 0, 0, ([0, 1], 2)),         # an odd core is left out rather than shared
    ([4, 6], 3, 2, 0, ([4, 6], 1)),                  # more workers than cores: shared, threads divided
    ([0, 1, 2, 3], 2, 0, 3, ([0, 1], 3)),            # workers.threads overrides the count
])
def test_workers_split_the_cores_they_own(cores, workers, index, requested, expected):
    assert plan(cores, workers, index, requested) == expected


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


def test_openmp_is_set_up_before_torch_loads():
    out = _python("from mcpd.cpu import threads\n"
                  "import os\n"
                  "n, applies = threads.configure(1, 0, 1, 'passive')\n"
                  "import torch\n"
                  "print(n, applies, os.environ['OMP_WAIT_POLICY'], torch.get_num_threads())")
    assert out == ["1", "True", "PASSIVE", "1"]


@pytest.mark.parametrize("policy, environment", [
    ("brief", ["unset", str(threads.BRIEF_SPINS)]),   # libgomp reads GOMP_SPINCOUNT only without a policy
    ("passive", ["PASSIVE", "unset"]),
    ("active", ["ACTIVE", "unset"]),
])
def test_each_wait_policy_sets_openmps_environment(policy, environment, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")   # what an operator or the test run may have set
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    out = _python("import os\n"
                  "from mcpd.cpu import threads\n"
                  f"threads.configure(1, 0, 1, {policy!r})\n"
                  "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), os.environ.get('GOMP_SPINCOUNT', 'unset'))")
    assert out == environment


def test_workers_sharing_cores_sleep_at_once_however_brief_their_policy():
    out = _python("import os\n"
                  "from mcpd.cpu import threads\n"
                  "threads.configure(len(os.sched_getaffinity(0)) + 1, 0, 1, 'brief')\n"
                  "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), os.environ.get('GOMP_SPINCOUNT', 'unset'))")
    assert out == ["PASSIVE", "unset"]


def test_the_worker_imports_torch_only_after_setting_up_threads():
    out = _python("import sys, mcpd.daemon.worker.process, mcpd.engine\n"
                  "print('torch' in sys.modules)\n"
                  "from mcpd.cpu import threads\n"
                  "import torch\n"
                  "print(threads.configure(1, 0, 0, 'passive')[1])")
    assert out == ["False", "False"]   # torch came first: the wait policy no longer applies


# A fresh interpreter on (at most) two of this machine's cores, its OpenMP team started as a
# worker starts it: set up before torch loads, then bound. Prints nothing; `cores` are the two.
TWO_CORE_TEAM = ("import os\n"
                 "from mcpd.cpu import threads\n"
                 "cores = sorted(os.sched_getaffinity(0))[:2]\n"
                 "os.sched_setaffinity(0, cores)\n"
                 "threads.configure(1, 0, 0, 'passive')\n"
                 "import torch\n"
                 "threads.start_team()\n")


def test_the_team_is_bound_and_the_main_thread_goes_free_below_every_thread():
    """start_team() binds OpenMP's threads one to a core (a pause's wake-up then cannot stack two
    on one core); set_count() below the full count frees the main thread to leave a neighbour's
    core, and binds it again at the full count. Two cores are enough to tell (the CI machine's)."""
    out = _python(TWO_CORE_TEAM +
                  "full = sorted(os.sched_getaffinity(0))\n"
                  "owned = threads.owned_cores() == cores\n"
                  "threads.set_count(1, 2)\n"
                  "fewer = sorted(os.sched_getaffinity(0))\n"
                  "threads.set_count(2, 2)\n"
                  "again = sorted(os.sched_getaffinity(0))\n"
                  "print(len(cores), full == again, len(full), fewer == cores, torch.get_num_threads(), owned)")
    if out[0] == "1":
        pytest.skip("one core: nothing to bind apart")
    assert out == ["2", "True", "1", "True", "2", "True"]   # owned_cores: the worker's, not the bound main thread's



def test_the_main_thread_is_held_to_its_core_only_while_the_engine_has_work():
    """main_thread_works frees the main thread on every owned core once the engine has had no work
    for FREE_AFTER_IDLE_S (an idle worker's loop; a shorter lull keeps it), and puts it back where
    steps run as work comes: its core, or every core once set_count() took a thread off, a choice
    set_count() may make while the thread is free. The clock is the caller's."""
    out = _python(TWO_CORE_TEAM +
                  "place = sorted(os.sched_getaffinity(0))\n"
                  "def idle_for(seconds):\n"
                  "    threads.main_thread_works(False, 0.0)\n"
                  "    threads.main_thread_works(False, seconds)\n"
                  "    return sorted(os.sched_getaffinity(0))\n"
                  "lull = idle_for(threads.FREE_AFTER_IDLE_S / 2)\n"
                  "idle = idle_for(threads.FREE_AFTER_IDLE_S)\n"
                  "threads.main_thread_works(True, 1.0)\n"
                  "working = sorted(os.sched_getaffinity(0))\n"
                  "idle_for(threads.FREE_AFTER_IDLE_S)\n"
                  "threads.set_count(1, 2)\n"
                  "idle_fewer = sorted(os.sched_getaffinity(0))\n"
                  "threads.main_thread_works(True, 2.0)\n"
                  "working_fewer = sorted(os.sched_getaffinity(0))\n"
                  "threads.set_count(2, 2)\n"
                  "print(len(cores), len(place), lull == place, idle == cores, working == place, "
                  "idle_fewer == cores, working_fewer == cores, sorted(os.sched_getaffinity(0)) == place)")
    if out[0] == "1":
        pytest.skip("one core: nothing to bind apart")
    assert out == ["2", "1", "True", "True", "True", "True", "True", "True"]


def test_run_delay_sees_a_neighbour_on_a_team_threads_core():
    """RunDelay.of_team() finds the team's threads (the caller's first, each once), and a busy
    process on one helper's core makes that helper wait for a CPU a large share of the time: the
    signal the thread tuner acts on. Two CPU-bound threads on one core share it, so the helper
    waits about half the time there (CONTENDED is 0.3)."""
    out = _python(TWO_CORE_TEAM +
                  "import subprocess, sys, threading\n"
                  "from mcpd.cpu.run_delay import RunDelay\n"
                  "from mcpd.cpu.thread_tuner import CONTENDED\n"
                  "run_delay = RunDelay.of_team(2)\n"
                  "ids = [int(path.split('/')[4]) for path in run_delay.paths]\n"
                  "helper_core = os.sched_getaffinity(ids[-1])\n"
                  "hog = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
                  "os.sched_setaffinity(hog.pid, helper_core)\n"
                  "x = torch.randn(1500, 1500)\n"
                  "run_delay.share()\n"
                  "for _ in range(30): x @ x\n"
                  "waited = run_delay.share()\n"
                  "hog.kill()\n"
                  "print(len(cores), ids[0] == threading.get_native_id(), len(set(ids)), waited >= CONTENDED)")
    if out[0] == "1":
        pytest.skip("one core: nothing to share")
    assert out == ["2", "True", "2", "True"]
