"""mcpctl drain, resume and reload: changing what the running daemon does."""
from __future__ import annotations

from mcpd.cli import control
from mcpd.cli.render import emit


def register(sub, common) -> None:
    drain = sub.add_parser("drain", parents=[common], help="stop admitting new work; in-flight requests finish")
    drain.add_argument("--wait", action="store_true", help="wait until nothing is in flight")
    drain.set_defaults(handler=cmd_drain)
    sub.add_parser("resume", parents=[common], help="admit new work again after a drain").set_defaults(handler=cmd_resume)
    reload = sub.add_parser("reload", parents=[common],
                            help="re-read the config file, apply what can change live, list what needs a restart")
    reload.add_argument("--wait", action="store_true", help="wait until every process confirms")
    reload.set_defaults(handler=cmd_reload)


def cmd_drain(args) -> int:
    result = control.call(args, "drain")
    if args.wait:
        control.wait_for(args, "draining", _inflight)
    emit(args, result, lambda _: "draining: new work is refused with UNAVAILABLE"
                                 + ("; nothing in flight" if args.wait else ""))
    return control.EXIT_OK


def _inflight(status: dict) -> str | None:
    if status["draining"] and status["queue"]["inflight"] == 0:
        return None
    return f"{status['queue']['inflight']} request(s) in flight"


def cmd_resume(args) -> int:
    emit(args, control.call(args, "resume"), lambda _: "admitting new work")
    return control.EXIT_OK


def cmd_reload(args) -> int:
    timeout_s = control.wait_timeout(args) if args.wait else 0
    # The daemon answers once every process confirmed, or when timeout_s ran out: wait a bit longer.
    result = control.call(args, "reload", {"timeout_s": timeout_s}, timeout_s=timeout_s + control.CALL_TIMEOUT_S)
    emit(args, result, render_reload)
    return control.EXIT_TIMEOUT if args.wait and result["unconfirmed"] else control.EXIT_OK


def render_reload(r: dict) -> str:
    lines = [f"reloaded {r['path'] or '(built-in defaults)'}",
             f"changed:       {', '.join(r['changed']) or 'nothing'}",
             f"applied live:  {', '.join(r['applied']) or '-'}",
             f"needs restart: {', '.join(r['needs_restart']) or '-'}"]
    if r["unconfirmed"]:
        lines.append(f"not confirmed by: {', '.join(r['unconfirmed'])}")
    return "\n".join(lines)
