"""The life of a component process: stop on SIGTERM/SIGINT (the preemption notice on GKE
and TPU VMs), announce `READY host:port` once serving (and `ALSO name host:port` for a
second service in the same process), report slow phases (checkpoint loads,
first compiles) as `PROGRESS <text>` lines, and wait for the stop signal."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from rlax_tpu.config import RunConfig, load_config
from rlax_tpu.rpc.auth import AuthTokenError, auth_token_from_env

# Runs `rlax-tpu ARGS...` in a child that gets SIGTERM when its parent dies
# (PR_SET_PDEATHSIG): `python -c CHILD_LAUNCHER ARGS...`. Set by the child itself, not by a
# preexec_fn: forking a multithreaded JAX process with a preexec_fn can deadlock. A parent
# that dies before the child's prctl call sends no signal; with PARENT_PID_ENV set to the
# parent's pid the child sees that (its parent is another process by then) and exits.
PARENT_PID_ENV = "RLAX_TPU_PARENT_PID"
CHILD_LAUNCHER = (
    "import ctypes, os, runpy, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    f"    if os.environ.pop('{PARENT_PID_ENV}', str(os.getppid())) != str(os.getppid()):\n"
    "        sys.exit('rlax-tpu: the launcher died before this process started')\n"
    "sys.argv = ['rlax-tpu', *sys.argv[1:]]\n"
    "runpy.run_module('rlax_tpu', run_name='__main__')\n"
)


def stop_on_signals(
    announce: Callable[[int], None] | None = None, *, again_exits: bool = False
) -> threading.Event:
    """An event that SIGTERM or SIGINT sets (call from the main thread). `announce(signum)`
    is called at once when it is set (to say what stopping will do); with `again_exits`, a
    second signal ends the process at once (exit code 130), its children told by their
    PR_SET_PDEATHSIG.

    The Python-level handler does nothing itself: it runs between two bytecodes of the main
    thread, which may hold the event's lock at that moment (inside `Event.wait`, or inside
    the `set` of an earlier signal), and `Event.set` there deadlocks the process, which then
    never exits. The C-level handler writes the signal's number to a wakeup pipe instead,
    and a thread of its own reads it and sets the event."""
    stop = threading.Event()
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    stopping = (signal.SIGTERM, signal.SIGINT)
    for sig in stopping:
        signal.signal(sig, lambda *_: None)

    def next_stop_signal() -> int:
        while (signum := os.read(read, 1)[0]) not in stopping:  # another handled signal
            pass
        return signum

    def watch() -> None:
        signum = next_stop_signal()
        stop.set()
        if announce is not None:
            announce(signum)
        if again_exits:
            next_stop_signal()
            print("stopping now", file=sys.stderr, flush=True)
            os._exit(130)

    threading.Thread(target=watch, name="stop-on-signal", daemon=True).start()
    return stop


def announce_ready(address: str, banner: str) -> None:
    """`banner` on stderr for people; exactly one `READY host:port` line on stdout for
    launchers and tests, which read it to learn the bound port."""
    print(banner, file=sys.stderr, flush=True)
    print(f"READY {address}", flush=True)


ALSO_PREFIX = "ALSO "


def announce_also(name: str, address: str) -> None:
    """A second service this process serves (a co-located inference worker inside the
    trainer's process), as one `ALSO <name> host:port` line on stdout; printed before the
    process's `READY` line, so a launcher knows both once it is ready."""
    print(f"{ALSO_PREFIX}{name} {address}", flush=True)


PROGRESS_PREFIX = "PROGRESS "
_progress_lock = threading.Lock()  # one whole line at a time: the engine thread reports too


def announce_progress(text: str) -> None:
    """Report a slow phase of this component (a checkpoint load, a first compile) as one
    `PROGRESS <text>` line on stdout, which the local launcher echoes to the run's console
    under the component's name; the same text goes to stderr (the component's log). For
    rare events only: never per step."""
    line = " ".join(str(text).split())  # one line, whatever the text holds
    with _progress_lock:
        sys.stdout.write(f"{PROGRESS_PREFIX}{line}\n")
        sys.stdout.flush()
        print(f"progress: {line}", file=sys.stderr, flush=True)


def wait_for(stop: threading.Event) -> None:
    """Block until `stop` is set; a timed wait, so the signal handler always gets to run."""
    while not stop.wait(1.0):
        pass


def component_config(args: argparse.Namespace, component: str) -> tuple[RunConfig, str] | None:
    """The run config of `serve COMPONENT [CONFIG] [--set ...]` and the auth token from the
    env var it names; None (after saying which variable is unset) when there is no token.
    A bad config raises ConfigError, which the CLI prints (exit 2)."""
    from rlax_tpu.runtime import configure_jax

    config = (
        load_config(args.config, args.overrides)
        if args.config
        else RunConfig().apply_overrides(args.overrides)
    )
    configure_jax(config)  # before JAX starts its backends (cpu_devices)
    try:
        return config, auth_token_from_env(config.param_server.auth_token_env)
    except AuthTokenError as e:
        print(f"rlax-tpu serve {component}: {e}", file=sys.stderr)
        return None


def bind_server(
    component: str,
    config: RunConfig,
    host: str,
    port: int,
    *,
    auth_token: str,
    max_workers: int,
    max_receive_bytes: int | None = None,
) -> tuple[Any, int] | None:
    """The gRPC server of `serve COMPONENT` on host:port (0 = any free) and the port bound,
    not started; None (after saying why, e.g. the port is taken) when it cannot listen.
    `max_receive_bytes`: the largest message a call may send (default: MAX_MESSAGE_BYTES)."""
    from rlax_tpu.rpc.channels import MAX_MESSAGE_BYTES, make_server

    try:
        return make_server(
            host,
            port,
            auth_token=auth_token,
            auth_token_env=config.param_server.auth_token_env,
            max_workers=max_workers,
            max_receive_bytes=max_receive_bytes or MAX_MESSAGE_BYTES,
        )
    except OSError as e:
        print(f"rlax-tpu serve {component}: {e}", file=sys.stderr)
        return None


def join_distributed_job(component: str) -> Any:
    """Join the JAX job the environment describes (rlax_tpu.distributed), before anything
    touches a device; returns its DistributedEnv, or None after saying what is wrong with
    the environment (the caller exits 2)."""
    from rlax_tpu.distributed import DistributedConfigError, initialize_from_environment

    try:
        return initialize_from_environment()
    except DistributedConfigError as e:
        print(f"rlax-tpu serve {component}: {e}", file=sys.stderr)
        return None
