"""The `mcpd` command (pip's script calls main) and `python -m mcpd`: start the daemon.

Every child the supervisor starts imports this module again (multiprocessing's fork server, like
its spawn, re-runs the parent's main module before the child's target), so it imports nothing until main() runs: a child
then loads only what it runs, not the supervisor's whole import graph (the front-end's aiohttp,
the scheduler's tokenizer and prometheus_client, each a noticeable import).
"""
import sys


def main(argv: list[str] | None = None) -> int:
    from mcpd.daemon.supervisor.process import main as supervise
    return supervise(argv)


if __name__ == "__main__":
    sys.exit(main())
