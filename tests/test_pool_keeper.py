"""The device pool keeper in a real daemon: a process of its own in the process table, the pool
and its regions in `status`, KV blocks that survive a worker's SIGKILL, and the refusals of a
pool too small or a segment not to be trusted."""
import json
import os
import re
import signal
from pathlib import Path

import pytest

from mcpd import config as config_module
from mcpd.daemon import pool_keeper
from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import PoolBusy
from mcpd.protocol import codes
from mcpd.refusal import StartRefused
from pool_keeping import DEVICES
from test_worker_crash import start_long_stream
from tiny_checkpoints import make_checkpoint

pytestmark = pytest.mark.slow   # each test starts a daemon

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
FIGURES = ("prefix_cache_hits", "tokens_prefilled", "host_kv_loaded")


def worker_figures(d) -> dict:
    return d.status()["devices"][0]


def reply(ctx, text: str) -> list[int]:
    return ctx.generate(text, **GREEDY).token_ids


def turn(d, ctx, text: str) -> tuple[list[int], dict]:
    """A chat turn's reply tokens, and how the worker's prefill and cache counters moved (each
    status waits for fresh figures from every child: up to their 0.5 s report interval)."""
    before = worker_figures(d)
    tokens = reply(ctx, text)
    after = worker_figures(d)
    return tokens, {name: after[name] - before[name] for name in FIGURES}


@pytest.mark.parametrize("device", DEVICES)
def test_the_keeper_is_a_process_and_status_shows_its_pool_and_regions(fresh_daemon, device):
    d = fresh_daemon(workers={"count": 2, "device": device})
    status = d.status()
    keeper = next(p for p in status["processes"] if p["role"] == "keeper")
    assert keeper["state"] == "running"
    [pool] = status["pools"]
    assert pool["device"] == ("cpu" if device == "cpu" else "cuda:0") and pool["keeper_pid"] == keeper["pid"]
    workers = {p["index"]: p["pid"] for p in status["processes"] if p["role"] == "worker"}
    assert sorted((r["kind"], r["owner"], r["pid"]) for r in pool["regions"]) == \
        [("kv", 0, workers[0]), ("kv", 1, workers[1]), ("weights", 0, workers[0]), ("weights", 1, workers[1])]
    assert pool["in_use_bytes"] >= sum(r["bytes"] for r in pool["regions"])
    assert all(w["pool"]["shared"] for w in status["devices"])
    # A CPU keeper sizes and makes its pool without torch (parameter_table.py): a second of CPU a start.
    assert device != "cpu" or "libtorch" not in Path(f"/proc/{keeper['pid']}/maps").read_text()


@pytest.mark.parametrize("device", DEVICES)
def test_turn_11_after_a_sigkill_reuses_the_device_kv(fresh_daemon, device):
    """Chat A runs ten turns; the worker is SIGKILLed while it writes another sequence's blocks;
    turn 11 on its successor (weights from the pool, not the disk) recomputes nothing an uninterrupted run would not (chat B, the same
    turns in another tenant, never interrupted) but the rows of turn 10's partial last block (not
    in the validity records: kv_records.py holds whole blocks), loads nothing from the host
    cache, and replies with the same tokens."""
    d = fresh_daemon(workers={"device": device})
    texts = [f" turn {i}: tell me more about pools" for i in range(11)]
    with d.client(tenant="alice") as alice, d.client(tenant="bob") as bob:
        chat_a, chat_b = alice.context("a"), bob.context("b")
        for text in texts[:10]:   # tokens only: the counters that matter are turn 11's
            assert reply(chat_a, text) == reply(chat_b, text)
        expected_tokens, expected = turn(d, chat_b, texts[10])
        old_pid = d.pid_of("worker")
        outcome = []
        writing = start_long_stream(d, outcome)   # alice's tenant: blocks are being written at the kill
        os.kill(old_pid, signal.SIGKILL)
        writing.join(60)
        assert outcome == [codes.WORKER_LOST]
        d.wait_until(lambda: d.status()["state"] == "ready", 60, "worker back")
        assert d.pid_of("worker") != old_pid
        successor = worker_figures(d)["pool"]
        tokens, moved = turn(d, chat_a, texts[10])
    assert successor["kv_blocks_adopted"] > 0 and successor["weights_from_pool"]
    assert tokens == expected_tokens
    tail_rows = expected["prefix_cache_hits"] - moved["prefix_cache_hits"]
    assert 0 <= tail_rows < 16 and moved["tokens_prefilled"] == expected["tokens_prefilled"] + tail_rows
    assert moved["host_kv_loaded"] == 0 and moved["prefix_cache_hits"] > 0


def test_a_pool_too_small_for_the_model_refuses_to_start_with_the_numbers(fresh_daemon):
    d = fresh_daemon(started=False, pool={"bytes": 24 << 20})   # the weights fit, their KV cache does not
    d.start(wait=False)
    assert d.process.wait(120) == 2
    assert re.search(r"POOL_TOO_SMALL: worker 0 needs a kv region of \d+ bytes; the device pool has \d+ of "
                     r"25165824 bytes free", d.log())


@pytest.mark.parametrize("pool", [{}, {"bytes": 64 << 20}], ids=["auto", "explicit"])
def test_a_checkpoint_with_a_hostile_layer_count_is_refused_at_start_by_name(fresh_daemon, tmp_path, pool):
    """A count past its cap in config.json stops the start with the file and the field (exit 2),
    whether or not the keeper sizes the pool from the model: not a keeper listing 10^9 layers, nor
    a worker failing and restarting every 30 s."""
    path = make_checkpoint(tmp_path / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    d = fresh_daemon(started=False, model={"path": str(path)}, pool=pool)
    d.start(wait=False)
    assert d.process.wait(120) == 2
    assert f"mcpd: model: {path / 'config.json'}: num_hidden_layers 1000000000 is not a whole number from 1 to 4096" \
        in d.log()


def test_a_keeper_meeting_an_unusable_model_refuses_instead_of_restarting(tmp_path):
    """Its own check, for a config.json that changed after the supervisor's (a keeper restarted
    later sizes the pool again): the same reason, as a start refusal."""
    path = make_checkpoint(tmp_path / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 2 ** 62}))
    settings = config_module.from_dict({"model": {"path": str(path)}})
    with pytest.raises(StartRefused, match="model: .*vocab_size 4611686018427387904 is not a whole number"):
        pool_keeper.pool_bytes(settings, "cpu", 1)


def test_a_dead_keeper_takes_its_workers_down_and_the_set_comes_back_but_a_segment_not_ours_stops_it(fresh_daemon):
    """A SIGKILLed keeper: its workers go down with it and the set comes back on a fresh pool.
    Then a segment whose mode was opened up under the running daemon: the restarted worker does
    not map it, and the daemon stops with the reason instead of trusting it. (One daemon for
    both: each start costs ~2.5 s of the suite's CPU.)"""
    d = fresh_daemon()
    keeper, worker = d.pid_of("keeper"), d.pid_of("worker")
    os.kill(keeper, signal.SIGKILL)
    d.wait_until(lambda: d.pid_of("worker") not in (None, worker) and d.status()["state"] == "ready", 60,
                 "keeper and worker back")
    [pool] = d.status()["pools"]
    assert pool["keeper_pid"] not in (None, keeper)
    assert {(r["owner"], r["pid"]) for r in pool["regions"]} == {(0, d.pid_of("worker"))}
    with d.client() as client:
        assert client.generate("again", max_tokens=3, ignore_eos=True).completion_tokens == 3

    [path] = pool_segment.every_segment(d.runtime_dir)
    os.chmod(path, 0o666)
    os.kill(d.pid_of("worker"), signal.SIGKILL)
    assert d.process.wait(120) == 3
    assert f"device pool segment {path}: owner uid {os.geteuid()}, mode 666" in d.log()


def test_a_dead_workers_standby_is_promoted_and_replaced(fresh_daemon):
    d = fresh_daemon(workers={"standby": True})
    d.wait_until(lambda: "standing by for worker 0" in d.log(), 60, "a standby")
    old_pid = d.pid_of("worker")
    os.kill(old_pid, signal.SIGKILL)
    d.wait_until(lambda: d.pid_of("worker") not in (None, old_pid) and d.status()["state"] == "ready", 60,
                 "worker back")
    assert f"promoted the standby of worker 0 (pid {d.pid_of('worker')})" in d.log()
    assert worker_figures(d)["pool"]["weights_from_pool"]
    with d.client() as client:
        assert client.generate("again", max_tokens=3, ignore_eos=True).completion_tokens == 3
    d.wait_until(lambda: d.log().count("standing by for worker 0") == 2, 60, "a new standby")


def test_a_removed_workers_regions_go_back_to_the_pool(fresh_daemon):
    """pool_keeper.reclaim, the supervisor's call when a worker index is removed, on a real
    daemon's pool: refused while the worker runs; once it is dead, its regions are freed and
    its successor starts on fresh ones. The backoff is far longer than the test: `workers.restart`
    starts a worker waiting it out at once."""
    d = fresh_daemon(workers={"count": 2, "restart_backoff_s": 3600, "restart_backoff_max_s": 3600})
    config = config_module.load(str(d.config_path))
    with pytest.raises(PoolBusy, match="still runs"):
        pool_keeper.reclaim(config, "cpu", 1)
    old_pid = d.pid_of("worker", 1)
    os.kill(old_pid, signal.SIGKILL)
    d.wait_until(lambda: next(p for p in d.processes() if p["role"] == "worker" and p["index"] == 1)["state"]
                 == "restarting", 30, "worker 1 reaped")
    assert pool_keeper.reclaim(config, "cpu", 1) == 2
    [pool] = d.status()["pools"]
    assert {r["owner"] for r in pool["regions"]} == {0}
    assert pool["in_use_bytes"] == sum(-(-r["bytes"] // pool_segment.MIN_BLOCK) * pool_segment.MIN_BLOCK
                                       for r in pool["regions"])
    restarted = d.mcpctl("workers", "restart", "1", "--wait")   # the control op, as an operator sends it
    assert restarted.returncode == 0, restarted.stderr
    assert "worker 1 starting now, not after its restart backoff; serving again as pid" in restarted.stdout
    d.wait_until(lambda: d.pid_of("worker", 1) not in (None, old_pid) and d.status()["state"] == "ready", 60,
                 "worker 1 back")
    successor = next(w for w in d.status()["devices"] if w["worker"] == 1)
    assert not successor["pool"]["weights_from_pool"] and successor["pool"]["kv_blocks_adopted"] == 0
