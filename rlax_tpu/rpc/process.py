"""The life of a component process: stop on SIGTERM/SIGINT (the preemption notice on GKE
and TPU VMs), announce `READY host:port` once serving, and wait for the stop signal."""

from __future__ import annotations

import signal
import sys
import threading


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM or SIGINT sets (call from the main thread)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def announce_ready(address: str, banner: str) -> None:
    """`banner` on stderr for people; exactly one `READY host:port` line on stdout for
    launchers and tests, which read it to learn the bound port."""
    print(banner, file=sys.stderr, flush=True)
    print(f"READY {address}", flush=True)


def wait_for(stop: threading.Event) -> None:
    """Block until `stop` is set; a timed wait, so the signal handler always gets to run."""
    while not stop.wait(1.0):
        pass
