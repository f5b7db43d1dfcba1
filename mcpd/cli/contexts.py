"""mcpctl contexts: list, show and drop contexts of any tenant."""
from __future__ import annotations

from mcpd.cli import control
from mcpd.cli.render import emit, mib, table
from mcpd.protocol.tenant import DEFAULT_TENANT


def register(sub, common) -> None:
    contexts = sub.add_parser("contexts", parents=[common], help="list, show or drop contexts")
    actions = contexts.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="contexts of every tenant, or of one")
    listing.add_argument("--tenant", help="only this tenant's")
    listing.add_argument("--limit", type=int, default=1000, help="show at most this many (default 1000)")
    listing.set_defaults(handler=cmd_list)
    for name, handler, text in (("show", cmd_show, "one context: version, fields, sizes"),
                                ("drop", cmd_drop, "delete one context (and its journal entries)")):
        action = actions.add_parser(name, parents=[common], help=text)
        action.add_argument("id")
        action.add_argument("--tenant", default=DEFAULT_TENANT, help=f"its tenant (default {DEFAULT_TENANT!r})")
        action.set_defaults(handler=handler)


def cmd_list(args) -> int:
    result = control.call(args, "contexts.list", {"owner": args.tenant, "limit": args.limit})
    emit(args, result, render_list)
    return control.EXIT_OK


def render_list(result: dict) -> str:
    rows = [[c["owner"], c["id"], c["version"], c["tokens"], len(c["fields"]), mib(c["bytes"]),
             "yes" if c["busy"] else "-"] for c in result["contexts"]]
    shown = f"{len(rows)} of {result['total']} context(s)"
    return table(["TENANT", "ID", "VERSION", "TOKENS", "FIELDS", "SIZE", "BUSY"], rows) + "\n" + shown


def cmd_show(args) -> int:
    emit(args, control.call(args, "contexts.show", {"owner": args.tenant, "id": args.id}), render_show)
    return control.EXIT_OK


def render_show(c: dict) -> str:
    head = f"{c['owner']}/{c['id']}  version {c['version']}  tokens {c['tokens']}  size {mib(c['bytes'])}"
    return head + "\n" + table(["FIELD", "TYPE", "DTYPE", "SHAPE", "CHANGED AT"],
                               [[f["name"], f["type"], f["dtype"] or "-", f["shape"] if f["shape"] is not None else "-",
                                 f["version"]] for f in c["fields"]])


def cmd_drop(args) -> int:
    result = control.call(args, "contexts.drop", {"owner": args.tenant, "id": args.id})
    emit(args, result, lambda r: f"dropped {args.tenant}/{args.id}" if r["dropped"]
         else f"no context {args.tenant}/{args.id}")
    return control.EXIT_OK if result["dropped"] else control.EXIT_FAILED
