"""`mcpctl`: the operator's view of a running mcpd, over the control socket in its runtime dir.

Exit codes: 0 healthy, 1 reachable but unhealthy (or another failure), 2 usage error,
3 daemon not reachable.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import zmq

from mcpd import config as config_module
from mcpd.client.replies import result_of
from mcpd.config import ConfigError
from mcpd.daemon import channels
from mcpd.protocol import wire
from mcpd.protocol.codes import MCPDError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
SYSTEM_RUNTIME_DIR = Path("/run/mcpd")


class Unreachable(Exception):
    pass


def find_runtime_dir(args) -> Path:
    """--runtime-dir, then $MCPD_RUNTIME_DIR, then the config's, then the systemd unit's /run/mcpd."""
    explicit = args.runtime_dir or os.environ.get("MCPD_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    configured = config_module.load(args.config).runtime_dir
    if not (configured / "control.ipc").exists() and (SYSTEM_RUNTIME_DIR / "control.ipc").exists():
        return SYSTEM_RUNTIME_DIR
    return configured


def control_call(runtime_dir: Path, op: str, timeout_s: float) -> dict:
    if not (runtime_dir / "control.ipc").exists():
        raise Unreachable(f"no control socket at {runtime_dir / 'control.ipc'}: is mcpd running?")
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(channels.control_endpoint(runtime_dir))
        sock.send(wire.encode_request(op, 1))
        if not sock.poll(timeout_s * 1000):
            raise Unreachable(f"mcpd did not answer on {runtime_dir / 'control.ipc'} within {timeout_s:g}s")
        return result_of(wire.decode_reply(sock.recv()))
    finally:
        sock.close(0)
        context.term()


def render_status(status: dict) -> str:
    lines = [f"mcpd {status['version']}  pid {status['pid']}  state {status['state']}  "
             f"uptime {status['uptime_s']:.0f}s",
             f"endpoints: {', '.join(status['endpoints'])}", "",
             _table(["ROLE", "INDEX", "PID", "STATE", "UPTIME", "RESTARTS", "LAST EXIT"],
                    [[p["role"], p["index"], p["pid"] or "-", p["state"], f"{p['uptime_s']:.0f}s",
                      p["restarts"], p["last_exit"] or "-"] for p in status["processes"]]), ""]
    lines.append(_table(["WORKER", "DEVICE", "MODEL", "RUNNING", "WAITING", "KV USED", "POOL USED"],
                        [[d["worker"], d.get("device", "-"), d.get("model", "-"), d.get("running", "-"),
                          d.get("waiting", "-"), f"{d.get('kv_blocks_used', 0)}/{d.get('kv_blocks_total', 0)}",
                          _mib(d.get("pool", {}).get("in_use_bytes", 0))] for d in status["devices"]]))
    cache = status.get("cache", {})
    if cache.get("enabled"):
        lines += ["", f"host cache {_mib(cache['used_bytes'])} of {_mib(cache['total_bytes'])}  "
                      f"contexts {cache['contexts']} (+{cache['context_deltas']} deltas)  "
                      f"kv blocks {cache['kv_blocks']}  hits {cache['hits']}  "
                      f"misses {cache['misses']}  hit rate {cache['hit_rate']:.1%}  evictions {cache['evictions']}"]
    requests = status["requests"]
    lines += ["", f"queue depth {status['queue']['depth']}  in flight {status['queue']['inflight']}  "
                  f"served {requests['served']}  errors {sum(requests['errors'].values())}"]
    classes = status.get("scheduler", {}).get("classes", {})
    if classes:
        lines.append("  classes: " + "  ".join(f"{name} q={c['queued']} window {c['window_ms']:.1f} ms"
                                              for name, c in classes.items()))
    for op, lat in sorted(requests["latency"].items()):
        lines.append(f"  {op:<10} n={lat['count']:<6} p50 {lat['p50_ms']:.2f} ms  p99 {lat['p99_ms']:.2f} ms")
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def cmd_status(args) -> int:
    status = control_call(find_runtime_dir(args), "status", args.timeout)
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return EXIT_OK if status["healthy"] else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcpctl", description="control a running mcpd")
    parser.add_argument("--runtime-dir", help="the daemon's runtime directory (default: from config, or /run/mcpd)")
    parser.add_argument("--config", help="the daemon's config file, to find its runtime directory")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon (default 5)")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="processes, devices, queues, latency")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(handler=cmd_status)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except Unreachable as e:
        print(f"mcpctl: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (MCPDError, ConfigError) as e:
        print(f"mcpctl: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
