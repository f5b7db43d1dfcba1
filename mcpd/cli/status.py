"""mcpctl status (once or --watch), ping, config and version: reading the daemon's state."""
from __future__ import annotations

import mcpd
from mcpd.cli import control, models
from mcpd.cli.render import emit, mib, redraw_until_interrupted, table


def register(sub, common) -> None:
    status = sub.add_parser("status", parents=[common], help="processes, devices, queues, contexts, latency")
    status.add_argument("--watch", action="store_true", help="redraw until interrupted")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    status.set_defaults(handler=cmd_status)
    sub.add_parser("ping", parents=[common], help="whether the daemon answers (open to any user who can connect)"
                   ).set_defaults(handler=cmd_ping)
    sub.add_parser("config", parents=[common], help="the effective configuration").set_defaults(handler=cmd_config)
    sub.add_parser("version", parents=[common], help="mcpctl's and the daemon's versions").set_defaults(handler=cmd_version)


def cmd_status(args) -> int:
    if not args.watch:
        status = control.call(args, "status")
        emit(args, status, render_status)
        return control.EXIT_OK if status["healthy"] else control.EXIT_FAILED
    redraw_until_interrupted(args, lambda: control.call(args, "status"), render_status, args.interval)
    return control.EXIT_OK


def render_status(status: dict) -> str:
    lines = [f"mcpd {status['version']}  pid {status['pid']}  state {status['state']}  "
             f"uptime {status['uptime_s']:.0f}s",
             f"endpoints: {', '.join(status['endpoints'])}"]
    if status.get("metrics"):
        lines.append(f"metrics: {status['metrics']}")
    http = status.get("http", {})
    if http.get("enabled"):
        lines.append(f"http: {http['url'] or '(starting)'}  auth {'on' if http['auth'] else 'off'}  "
                     f"in flight {http['inflight']}")
    lines += ["", table(["ROLE", "INDEX", "PID", "STATE", "UPTIME", "RESTARTS", "LAST EXIT"],
                        [[p["role"], p["index"], p["pid"] or "-", p["state"], f"{p['uptime_s']:.0f}s",
                          p["restarts"], p["last_exit"] or "-"] for p in status["processes"]]), ""]
    lines.append(table(["WORKER", "DEVICE", "KERNELS", "MODEL", "RUNNING", "WAITING", "KV USED", "POOL USED"],
                       [[d["worker"], d.get("device", "-"), d.get("kernels", "-"), d.get("model", "-"),
                         d.get("running", "-"), d.get("waiting", "-"),
                         f"{d.get('kv_blocks_used', 0)}/{d.get('kv_blocks_total', 0)}",
                         mib(d.get("pool", {}).get("in_use_bytes", 0))] for d in status["devices"]]))
    if status.get("models", {}).get("models"):
        lines += ["", models.render_models(status["models"])]
    for pool in status.get("pools", []):
        lines.append(f"device pool {pool['device']}  keeper {pool['keeper']} pid {pool['keeper_pid'] or '-'}  "
                     f"{mib(pool.get('in_use_bytes', 0))} of {mib(pool.get('total_bytes', 0))} in use  "
                     f"fragmentation {pool.get('external_fragmentation', 0):.3f}")
        lines += [f"  {r['kind']:<8} worker {r['owner']}  pid {r['pid']}{'' if r['pid_alive'] else ' (gone)'}  "
                  f"{mib(r['bytes'])} at {r['offset']}" for r in pool.get("regions", [])]
    contexts = status["contexts"]
    lines += ["", f"contexts {contexts['contexts']} ({mib(contexts['bytes'])})  restored at start "
                  f"{contexts['restored']}  journal fsync {contexts['persistence'].get('fsync', '-')}"]
    cache = status.get("cache", {})
    if cache.get("enabled"):
        lines.append(f"host cache {mib(cache['used_bytes'])} of {mib(cache['total_bytes'])}  "
                     f"contexts {cache['contexts']} (+{cache['context_deltas']} deltas)  "
                     f"kv blocks {cache['kv_blocks']}  hits {cache['hits']}  "
                     f"misses {cache['misses']}  hit rate {cache['hit_rate']:.1%}  evictions {cache['evictions']}")
    cluster = status.get("cluster") or {}
    if cluster:
        lines.append(f"cluster node {cluster['node']}  heartbeat {cluster['heartbeat']}  live nodes "
                      f"{len(cluster['nodes'])}: " + ", ".join(sorted(cluster["nodes"])))
    requests = status["requests"]
    lines += [f"queue depth {status['queue']['depth']}  in flight {status['queue']['inflight']}  "
              f"served {requests['served']}  errors {sum(requests['errors'].values())}"]
    classes = status.get("scheduler", {}).get("classes", {})
    if classes:
        lines.append("  classes: " + "  ".join(f"{name} q={c['queued']} window {c['window_ms']:.1f} ms"
                                              for name, c in classes.items()))
    for op, lat in sorted(requests["latency"].items()):
        lines.append(f"  {op:<10} n={lat['count']:<6} p50 {lat['p50_ms']:.2f} ms  "
                     f"p90 {lat['p90_ms']:.2f} ms  p99 {lat['p99_ms']:.2f} ms")
    return "\n".join(lines)


def cmd_ping(args) -> int:
    emit(args, control.call(args, "ping"), lambda r: f"mcpd answers (supervisor pid {r['pid']})")
    return control.EXIT_OK


def cmd_config(args) -> int:
    emit(args, control.call(args, "config"), render_config)
    return control.EXIT_OK


def render_config(result: dict) -> str:
    lines = [f"# effective configuration (file: {result['path'] or 'none, built-in defaults'})"]
    for section, keys in result["config"].items():
        lines += ["", f"[{section}]"] + [f"{key} = {value!r}" for key, value in keys.items()]
    return "\n".join(lines)


def cmd_version(args) -> int:
    mine = {"mcpctl": mcpd.__version__}
    try:
        daemon = control.call(args, "version")
    except control.Unreachable as e:
        why = str(e)
        emit(args, {**mine, "daemon": None}, lambda _: f"mcpctl {mcpd.__version__}\nmcpd: {why}")
        return control.EXIT_UNREACHABLE
    emit(args, {**mine, "daemon": daemon}, lambda _: f"mcpctl {mcpd.__version__}\n{render_daemon_version(daemon)}")
    return control.EXIT_OK


def render_daemon_version(daemon) -> str:
    """The daemon's versions; a field the reply lacks (an older or foreign daemon) is "unknown"."""
    fields = daemon if isinstance(daemon, dict) else {}
    version, protocol, python = (fields.get(key, "unknown") for key in ("version", "protocol", "python"))
    return f"mcpd {version} (protocol {protocol}, Python {python})"
