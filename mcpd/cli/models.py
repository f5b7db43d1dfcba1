"""mcpctl models: the model table's models and versions, and their traffic policies, changed live."""
from __future__ import annotations

import argparse

from mcpd.cli import control
from mcpd.cli.render import emit, table


def register(sub, common) -> None:
    models = sub.add_parser("models", parents=[common], help="list models and versions; change their traffic")
    actions = models.add_subparsers(dest="action")
    models.set_defaults(handler=cmd_list)
    actions.add_parser("list", parents=[common], help="models, versions, policies, workers (the default)"
                       ).set_defaults(handler=cmd_list)
    for name, op, text in (("promote", "models.promote", "send every new request of MODEL to VERSION"),
                           ("load", "models.load", "start VERSION's workers; it takes requests"),
                           ("unload", "models.unload", "stop VERSION's workers once its requests are done")):
        action = actions.add_parser(name, parents=[common], help=text)
        action.add_argument("model")
        action.add_argument("version")
        action.set_defaults(handler=_versioned(op))
    rollback = actions.add_parser("rollback", parents=[common], help="back to MODEL's policy before its last "
                                                                     "promote or split")
    rollback.add_argument("model")
    rollback.set_defaults(handler=cmd_rollback)
    shadow = actions.add_parser("shadow", parents=[common], help="run a share of MODEL's requests on VERSION "
                                                                 "too and compare (no VERSION: off)")
    shadow.add_argument("model")
    shadow.add_argument("version", nargs="?")
    shadow.add_argument("--fraction", type=float, default=0.1, help="the share of requests (default 0.1)")
    shadow.set_defaults(handler=cmd_shadow)
    split = actions.add_parser("split", parents=[common], help="spread MODEL's new requests by weight, "
                                                               "e.g. split llama v1=90 v2=10")
    split.add_argument("model")
    split.add_argument("weights", nargs="+", type=_weight, metavar="VERSION=WEIGHT")
    split.set_defaults(handler=cmd_split)


def _weight(text: str) -> tuple[str, float]:
    version, sep, weight = text.partition("=")
    try:
        if sep and version:
            return version, float(weight)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: use VERSION=WEIGHT, e.g. v2=10")


def cmd_list(args) -> int:
    emit(args, control.call(args, "status")["models"], render_models)
    return control.EXIT_OK


def render_models(models: dict) -> str:
    rows = []
    for name, model in (models.get("models") or {}).items():
        for version, v in model["versions"].items():
            role = "primary" if version == model["primary"] else ""
            if model["split"]:
                role = f"split {model['split'].get(version, 0):g}"
            processes = ", ".join(f"{p['index']} {p['state']}" for p in v.get("processes", [])) or "-"
            rows.append([name + (" (default)" if name == models.get("default_model") else ""), version,
                         "yes" if v["loaded"] else "no", role or "-", v["routed"], v["queued"], processes,
                         v.get("kind", "language")])
    return table(["MODEL", "VERSION", "LOADED", "TRAFFIC", "ROUTED", "QUEUED", "WORKERS", "KIND"], rows)


def _versioned(op: str):
    def handler(args) -> int:
        emit(args, control.call(args, op, {"model": args.model, "version": args.version}), _said)
        return control.EXIT_OK
    return handler


def cmd_rollback(args) -> int:
    emit(args, control.call(args, "models.rollback", {"model": args.model}), _said)
    return control.EXIT_OK


def cmd_shadow(args) -> int:
    result = control.call(args, "models.shadow", {"model": args.model, "version": args.version,
                                                  "fraction": args.fraction})
    emit(args, result, _said)
    return control.EXIT_OK


def cmd_split(args) -> int:
    emit(args, control.call(args, "models.split", {"model": args.model, "weights": dict(args.weights)}), _said)
    return control.EXIT_OK


def _said(result: dict) -> str:
    return "  ".join(f"{key} {value}" for key, value in result.items())
