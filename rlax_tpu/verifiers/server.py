"""The verifier process behind `rlax-tpu serve verifier`.

Starts a pool of worker processes (recycled after --max-tasks-per-worker tasks, each
capped at `verifiers.math_memory_limit_bytes`) for math and reasoning-gym checks and the
user's reward functions (those the config's datasets name are imported into every worker
as it starts; one that does not import refuses the start, exit 2, naming it), a
sandboxed CodeVerifier (up to --max-parallel-tests test cases of one request at once), a
ProgramRunner on the same sandbox for the programs of the policy's tools (Execute), and a
VerificationService over them with a bounded queue; serves Verifier and Health on one gRPC
server bound to loopback unless told otherwise, prints `READY host:port` on stdout once
serving, and on SIGTERM or SIGINT stops serving, answers what is queued and kills its
workers before exiting 0. Code problems are fetched from the
test-data repository into --test-data-cache once per host.

The sandbox is tested first, before the gRPC server and its threads exist. How code runs (bwrap or
refused, the uid programs run as, per-run cgroups or why none) is logged at startup and
reported in the metrics' "sandbox" map; when programs cannot run sandboxed as an
unprivileged uid, the log says so and every code request is refused with the reason
(`verifiers.allow_unsandboxed` is the only way to run them anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from rlax_tpu.config import RunConfig
from rlax_tpu.rpc import HealthServicer, format_address
from rlax_tpu.rpc.process import (
    announce_ready,
    bind_server,
    component_config,
    stop_on_signals,
    wait_for,
)
from rlax_tpu.verifiers.code import CodeVerifier
from rlax_tpu.verifiers.execution import ProgramRunner
from rlax_tpu.verifiers.functions import configured_reward_functions, loading_errors
from rlax_tpu.verifiers.local import LocalVerifier, pool_for
from rlax_tpu.verifiers.pool import TaskOutOfMemory, TaskTimeout, WorkerCrashed
from rlax_tpu.verifiers.repository import ProblemResolver
from rlax_tpu.verifiers.sandbox import SandboxUnavailable
from rlax_tpu.verifiers.service import (
    DEFAULT_DEADLINE_S,
    DEFAULT_QUEUE_CAPACITY,
    DEFAULT_RESULTS_CACHE_SIZE,
    VerificationService,
    VerifierServicer,
    verifier_status,
)

DEFAULT_INSTANCE_ID = "verifier-0"
DEFAULT_MAX_TASKS_PER_WORKER = 100
DEFAULT_MAX_PARALLEL_TESTS = 4
# Each Verify call holds a server thread until its batch is answered; callers are the
# controller's threads, so a few dozen at once is plenty (the queue bounds the real work).
_MAX_CALLS = 32
# How long the start-up check may take to report on the config's reward functions. The
# imports themselves run in each worker's initializer, under the pool's start timeout;
# the check reads what they left in a worker.
_REWARD_IMPORT_TIMEOUT_S = 60.0


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/rlax_tpu/test_data (default ~/.cache/...): kept across restarts."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rlax_tpu" / "test_data"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """What `serve verifier` runs with: its flags, else the config, else the defaults."""

    instance_id: str = DEFAULT_INSTANCE_ID
    num_workers: int = 2
    max_tasks_per_worker: int = DEFAULT_MAX_TASKS_PER_WORKER
    max_parallel_tests: int = DEFAULT_MAX_PARALLEL_TESTS
    queue_size: int = DEFAULT_QUEUE_CAPACITY
    results_cache: int = DEFAULT_RESULTS_CACHE_SIZE
    deadline_s: float = DEFAULT_DEADLINE_S
    test_data_cache: Path = dataclasses.field(default_factory=default_cache_dir)
    test_data_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_workers", "max_tasks_per_worker", "max_parallel_tests", "queue_size"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.results_cache < 0:
            raise ValueError(f"--results-cache must be >= 0, got {self.results_cache}")
        if not self.deadline_s > 0:
            raise ValueError(f"--deadline-s must be > 0, got {self.deadline_s}")


def options_from_args(args: argparse.Namespace, config: RunConfig) -> ServerOptions:
    """The flags given (None = not given) over `config.verifiers`; ValueError if one is bad."""
    given = {
        "instance_id": args.worker_id,
        "num_workers": args.num_workers,
        "max_tasks_per_worker": args.max_tasks_per_worker,
        "max_parallel_tests": args.max_parallel_tests,
        "queue_size": args.queue_size,
        "results_cache": args.results_cache,
        "deadline_s": args.deadline_s,
        "test_data_cache": Path(args.test_data_cache) if args.test_data_cache else None,
        "test_data_roots": tuple(args.test_data_root),
    }
    if given["num_workers"] is None:
        given["num_workers"] = config.verifiers.num_workers
    return ServerOptions(**{k: v for k, v in given.items() if v is not None})


def main(args: argparse.Namespace) -> int:
    """`rlax-tpu serve verifier`: serve until SIGTERM or SIGINT, then exit 0."""
    resolved = component_config(args, "verifier")
    if resolved is None:
        return 2
    config, token = resolved
    try:
        options = options_from_args(args, config)
    except ValueError as e:
        print(f"rlax-tpu serve verifier: {e}", file=sys.stderr)
        return 2

    # The sandbox's self-test runs now, while this process has a single thread.
    code_verifier = CodeVerifier(config.verifiers, max_parallel_tests=options.max_parallel_tests)
    sandbox = code_verifier.sandbox.identity()
    name = f"verifier {options.instance_id}"
    print(
        f"{name}: code runs: sandbox={sandbox['sandbox']} uid={sandbox['uid']} "
        f"cgroup={sandbox['cgroup']!r} ({sandbox['reason']})",
        file=sys.stderr,
        flush=True,
    )
    try:
        code_verifier.sandbox.check()
    except SandboxUnavailable as e:
        print(
            f"{name}: ERROR: code requests will be refused (verdict verifier_error): {e}",
            file=sys.stderr,
            flush=True,
        )
    host = args.host or "127.0.0.1"
    stop = stop_on_signals()
    bound = bind_server(
        "verifier", config, host, args.port, auth_token=token, max_workers=_MAX_CALLS
    )
    if bound is None:
        return 2
    server, port = bound
    resolver = ProblemResolver(options.test_data_cache, roots=options.test_data_roots)
    reward_functions = configured_reward_functions(config)
    pool = pool_for(
        config.verifiers,
        num_workers=options.num_workers,
        max_tasks_per_worker=options.max_tasks_per_worker,
        reward_functions=reward_functions,
    )
    if reward_functions:
        problem = _reward_functions_problem(pool, reward_functions)
        if problem:
            pool.close()
            print(f"rlax-tpu serve verifier: {problem}", file=sys.stderr, flush=True)
            return 2
        print(
            f"{name}: reward functions loaded: {', '.join(reward_functions)}",
            file=sys.stderr,
            flush=True,
        )
    try:
        verifier = LocalVerifier(
            config.verifiers, pool, code_verifier=code_verifier, problem_resolver=resolver
        )
        runner = ProgramRunner(config.verifiers, sandbox=code_verifier.sandbox)
        service = VerificationService(
            verifier.verify,
            execute=runner.execute,
            concurrency=options.num_workers,
            queue_capacity=options.queue_size,
            results_cache_size=options.results_cache,
            default_deadline_s=options.deadline_s,
            pool_stats=pool.stats,
            input_stats=verifier.stats,
            sandbox=sandbox,
        )
    except BaseException:
        pool.close()
        raise
    VerifierServicer(service).add_to_server(server)
    digest = config.digest()
    HealthServicer(
        lambda: verifier_status(service, instance_id=options.instance_id, config_digest=digest)
    ).add_to_server(server)
    server.start()
    address = format_address(host, port)
    announce_ready(
        address,
        f"verifier {options.instance_id}: {options.num_workers} workers (recycled every "
        f"{options.max_tasks_per_worker} tasks), queue {options.queue_size}, test data cached "
        f"in {options.test_data_cache}, listening on {address}",
    )
    try:
        wait_for(stop)
    finally:
        server.stop(5.0).wait()  # running batches get 5 s to be answered
        service.close(timeout_s=5.0)
        pool.close()  # kills the worker processes, including any still judging
    print(f"verifier {options.instance_id}: stopped", file=sys.stderr, flush=True)
    return 0


def _reward_functions_problem(pool: Any, specs: list[str]) -> str:
    """Why the reward functions `specs` cannot be served ("" = they all load): imported in
    a worker of `pool`, as requests will find them."""

    try:
        errors = pool.run(loading_errors, specs, timeout_s=_REWARD_IMPORT_TIMEOUT_S)
    except TaskTimeout:
        return (
            f"importing the reward functions {', '.join(specs)} took over "
            f"{_REWARD_IMPORT_TIMEOUT_S:g}s"
        )
    except (TaskOutOfMemory, WorkerCrashed) as e:
        return f"a worker importing the reward functions {', '.join(specs)} failed: {e}"
    if not errors:
        return ""
    return "cannot serve the config's reward functions: " + "; ".join(errors)
