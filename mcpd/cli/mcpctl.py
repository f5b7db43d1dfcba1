"""`mcpctl`: the operator's view of a running mcpd, over the control socket in its runtime dir.

Each command group lives in its own module with a `register(sub, common)`; add a group to
COMMAND_GROUPS. Exit codes are in mcpd/cli/control.py and `mcpctl --help`.
"""
from __future__ import annotations

import argparse
import sys

from mcpd.cli import cluster, contexts, control, keys, lifecycle, models, status, top, workers
from mcpd.config import ConfigError
from mcpd.protocol.codes import MCPDError
from mcpd.refusal import UnsafePath
from mcpd.security.keys import BadKey

COMMAND_GROUPS = (status, top, workers, models, contexts, cluster, lifecycle, keys)
EPILOG = """exit codes: 0 done (status: healthy), 1 failed (status: unhealthy, the daemon refused
the op, or the runtime directory is not safe to talk to), 2 usage error, 3 daemon not reachable, 4 timed out waiting (--wait).
The daemon is found by --runtime-dir, $MCPD_RUNTIME_DIR, the config's server.runtime_dir, or /run/mcpd."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcpctl", description="control a running mcpd", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime-dir", help="the daemon's runtime directory (default: $MCPD_RUNTIME_DIR, "
                                              "the config's, or /run/mcpd)")
    parser.add_argument("--config", help="the daemon's config file, to find its runtime directory")
    parser.add_argument("--timeout", type=control.seconds_in(control.MIN_TIMEOUT_S, control.MAX_TIMEOUT_S),
                        help=f"seconds to wait: for an answer (default {control.CALL_TIMEOUT_S:g}), or with --wait "
                             f"for the operation (default {control.WAIT_TIMEOUT_S:g})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    # --json may also follow the command; SUPPRESS keeps it from undoing one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON instead of tables")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except control.Unreachable as e:
        print(f"mcpctl: {e}", file=sys.stderr)
        return control.EXIT_UNREACHABLE
    except control.TimedOut as e:
        print(f"mcpctl: {e}", file=sys.stderr)
        return control.EXIT_TIMEOUT
    except (MCPDError, ConfigError, BadKey, UnsafePath, OSError) as e:
        print(f"mcpctl: {e}", file=sys.stderr)
        return control.EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
