"""mcpctl workers: list them, restart one."""
from __future__ import annotations

from mcpd.cli import control
from mcpd.cli.render import emit, mib, table


def register(sub, common) -> None:
    workers = sub.add_parser("workers", parents=[common], help="list workers, or restart one")
    actions = workers.add_subparsers(dest="action")
    workers.set_defaults(handler=cmd_list)
    actions.add_parser("list", parents=[common], help="every worker and its device (the default)").set_defaults(handler=cmd_list)
    restart = actions.add_parser("restart", parents=[common],
                                 help="restart worker N (its streaming requests get WORKER_LOST; queued ones move)")
    restart.add_argument("index", type=int)
    restart.add_argument("--wait", action="store_true", help="wait until the new worker serves")
    restart.set_defaults(handler=cmd_restart)


def cmd_list(args) -> int:
    emit(args, control.call(args, "workers"), render_workers)
    return control.EXIT_OK


def render_workers(result: dict) -> str:
    return table(["WORKER", "PID", "STATE", "DEVICE", "RUNNING", "WAITING", "POOL USED", "RESTARTS", "LAST EXIT"],
                 [[w["index"], w["pid"] or "-", w["state"], w.get("device", "-"), w.get("running", "-"),
                   w.get("waiting", "-"), mib(w.get("pool", {}).get("in_use_bytes", 0)), w["restarts"],
                   w["last_exit"] or "-"] for w in result["workers"]])


def cmd_restart(args) -> int:
    result = control.call(args, "workers.restart", {"index": args.index})
    if args.wait:
        control.wait_for(args, f"worker {args.index} restart", lambda s: _restarting(s, result))
        result["new_pid"] = _worker(control.call(args, "status"), args.index)["pid"]
    emit(args, result, lambda r: f"worker {r['index']} " + (f"(pid {r['old_pid']}) restarting" if r["old_pid"]
                                                           else "starting now, not after its restart backoff")
                                 + (f"; serving again as pid {r['new_pid']}" if "new_pid" in r else ""))
    return control.EXIT_OK


def _restarting(status: dict, result: dict) -> str | None:
    worker = _worker(status, result["index"])
    if worker["pid"] not in (None, result["old_pid"]) and worker["state"] == "running":
        return None
    return f"state {worker['state']}"


def _worker(status: dict, index: int) -> dict:
    return next(p for p in status["processes"] if p["role"] == "worker" and p["index"] == index)
