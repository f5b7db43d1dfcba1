"""mcpctl cluster: the nodes this daemon sees in its cluster (endpoints, heartbeat age, load, free
KV, models), how many of the recently used contexts each owns, its prefetch, and how far its Redis
is: the `cluster` part of `status`, laid out for an operator."""
from __future__ import annotations

from mcpd.cli import control
from mcpd.cli.render import emit, table

OFF = "clustering is off on this node: [cluster] redis is empty (docs/CLUSTER.md)"


def register(sub, common) -> None:
    sub.add_parser("cluster", parents=[common], help="the cluster's nodes, owners, load and Redis lag"
                   ).set_defaults(handler=cmd_cluster)


def cmd_cluster(args) -> int:
    status = control.call(args, "status")
    cluster = status.get("cluster") or {}
    view = {"enabled": bool(cluster), **cluster,
            "contexts_behind": status["contexts"].get("redis", {}).get("behind", 0)}
    emit(args, view, render_cluster)
    return control.EXIT_OK


def render_cluster(view: dict) -> str:
    if not view["enabled"]:
        return OFF
    rtt = view["redis_rtt_ms"]
    prefetch = view["prefetch"]
    last = prefetch["last_pass"]
    lines = [f"cluster node {view['node']}  heartbeat {view['heartbeat']}  live nodes {len(view['nodes'])}",
             f"redis: round trip {'-' if rtt is None else f'{rtt:.1f} ms'}  contexts behind "
             f"{view['contexts_behind']}  recently used contexts indexed {view['recent_indexed']}",
             f"prefetched {prefetch['prefetched']}" + (f"  last pass ({last['trigger']}): {last['loaded']} of "
                                                       f"{last['wanted']} read in {last['seconds']:.2f} s"
                                                       if last else ""), ""]
    owners = view["owners"]
    rows = [_row(node_id, report, "yes", f"{report['age_ms'] / 1000:.1f}s" if report.get("age_ms") is not None
                 else "-", owners.get(node_id, 0)) for node_id, report in sorted(view["nodes"].items())]
    rows += [_row(node_id, report, f"gone {report['gone_s']:.0f}s", "-", "-")
             for node_id, report in sorted(view["gone"].items())]
    lines.append(table(["NODE", "ALIVE", "HEARTBEAT AGE", "TCP", "HTTP", "WEIGHT", "QUEUED", "IN FLIGHT",
                        "FREE KV", "MODELS", "RECENT OWNED"], rows))
    return "\n".join(lines)


def _row(node_id: str, report: dict, alive: str, age: str, owned) -> list:
    cells = [node_id, report.get("tcp") or "-", report.get("http") or "-", report.get("weight", "-"),
             report.get("queued", "-"), report.get("inflight", "-"), report.get("free_kv_blocks", "-"),
             _models(report.get("models"))]
    node_id, tcp, http, *load = map(_shown, cells)
    return [node_id, alive, age, tcp, http, *load, owned]


def _models(models) -> str:
    return ",".join(map(str, models)) if isinstance(models, list) and models else "-"


def _shown(value) -> str:
    """A heartbeat's value as text, quoted when it is not printable: any node (or anyone who can
    write to Redis) wrote it, and a terminal must not take it for control sequences."""
    if value is None:   # a figure a node has not reported yet
        return "-"
    text = str(value)
    return text if text.isprintable() and " " not in text else repr(text)
