"""mcpctl top: a live view of models, classes and the slowest requests in flight, redrawn until
interrupted (--once: one frame, for scripts).

Tenants and model names come from clients: each is printed with its control characters escaped,
so a request cannot write escape sequences into the operator's terminal.
"""
from __future__ import annotations

from mcpd.cli import control
from mcpd.cli.render import emit, redraw_until_interrupted, table

MIN_INTERVAL_S = 0.1   # below this, redrawing is all a terminal would do
MAX_INTERVAL_S = 3600.0


def register(sub, common) -> None:
    top = sub.add_parser("top", parents=[common], help="a live view of models, classes and the slowest "
                                                       "requests in flight")
    top.add_argument("--interval", type=control.seconds_in(MIN_INTERVAL_S, MAX_INTERVAL_S), default=1.0,
                     help=f"seconds between redraws, {MIN_INTERVAL_S:g}..{MAX_INTERVAL_S:g} (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(handler=cmd_top)


def cmd_top(args) -> int:
    if args.once:
        emit(args, control.call(args, "status"), render_top)
        return control.EXIT_OK
    redraw_until_interrupted(args, lambda: control.call(args, "status"), render_top, args.interval)
    return control.EXIT_OK


def render_top(status: dict) -> str:
    requests = status["requests"]
    head = (f"mcpd {status['version']}  state {status['state']}  uptime {status['uptime_s']:.0f}s  "
            f"queue {status['queue']['depth']}  in flight {status['queue']['inflight']}  "
            f"served {requests['served']}  errors {sum(requests['errors'].values())}")
    models = status.get("models") or {}
    return "\n\n".join([head, _models_table(models), _classes_table(status.get("scheduler", {}).get("classes", {})),
                        _slowest_table(requests.get("slowest", []), models.get("default_model"))])


def _models_table(models: dict) -> str:
    rows = []
    for name, model in (models.get("models") or {}).items():
        for version, v in model["versions"].items():
            latency = v.get("latency") or {}
            rows.append([_safe(name), _safe(version), v["routed"], v.get("running", 0), v.get("answered", 0),
                         *(_ms(latency.get(p)) for p in ("p50_ms", "p90_ms", "p99_ms"))])
    return table(["MODEL", "VERSION", "ROUTED", "RUNNING", "ANSWERED", "P50", "P90", "P99"], rows)


def _classes_table(classes: dict) -> str:
    return table(["CLASS", "QUEUED", "MAX QUEUE", "WAIT P99"],
                 [[_safe(name), c["queued"], "-" if c.get("max_queue") is None else c["max_queue"],
                   _ms(c["queue_p99_ms"])] for name, c in classes.items()])


def _slowest_table(slowest: list, default_model: str | None) -> str:
    rows = [[r["rid"], _safe(r["tenant"]), _safe(r["op"]), _safe(r["model"] or default_model or "-"),
             f"{r['age_ms'] / 1000:.1f}s"] for r in slowest]
    return "slowest requests in flight\n" + table(["RID", "TENANT", "OP", "MODEL", "AGE"], rows)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _safe(text) -> str:
    """Text as printable characters only: a control character shows as its escape."""
    text = str(text)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
