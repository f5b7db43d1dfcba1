"""Imported by the fork server alone, among the modules it preloads (launcher.py), never by
the supervisor: it makes the server ignore SIGTERM.

A SIGTERM sent to the daemon's whole process group (`timeout`, a shell's `kill %1`; systemd's
KillMode=mixed sends it to the supervisor only) killed the server at once, and with it, by their
death signal, every child in the middle of its own SIGTERM handling: the scheduler making its
journal durable, the keeper removing its segment. The supervisor decides when the daemon stops;
the server exits with it (its "alive" pipe) and ignores SIGINT already (multiprocessing does).
A child forked from it inherits the ignored SIGTERM until child.start() restores the default.
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
