#!/usr/bin/env python3
"""Verifier-service throughput and latency on sandboxed Python solutions, and the sandbox's
cost per run against the same program unsandboxed.

    python tools/bench_verifier.py [--quick] [--json OUT] [--workers N]

In one run: upload a 10-test problem to a test-data repository in a temporary directory,
start a real `rlax-tpu serve verifier` process on loopback, and judge a mix of correct,
wrong and too-slow (busy-loop, 1 s CPU limit) Python solutions through it: once as one
Verify call per solution, all in flight at once (client-side latency per verification),
and once as a single batch. Then time one run of a correct solution in the bubblewrap
sandbox (in its per-run cgroup, and with cgroups off), with rlimits only, and as a bare
subprocess, interleaved, in this process.
Prints a table; --json writes the figures (verifications_per_s, p50_s, p95_s,
sandbox_overhead_s, ...).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlax_tpu.api.verifier import (  # noqa: E402
    Verdict,
    VerificationRequest,
    VerifierClient,  # noqa: E402
)
from rlax_tpu.verifiers.languages import LANGUAGES  # noqa: E402
from rlax_tpu.verifiers.problems import write_problem  # noqa: E402
from rlax_tpu.verifiers.repository import TestDataRepository  # noqa: E402
from rlax_tpu.verifiers.sandbox import SANDBOX_ENV, RunLimits, Sandbox  # noqa: E402

TIME_LIMIT_S = 1.0
NUM_TESTS = 10
# kind -> (expected verdict, programs); a kind's solutions cycle through its programs.
SOLUTIONS = {
    "correct": (
        Verdict.ACCEPTED,
        (
            "a, b = map(int, input().split())\nprint(a + b)\n",
            "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n",
            "x = [int(t) for t in input().split()]\ntotal = 0\nfor v in x:\n    total += v\n"
            "print(total)\n",
        ),
    ),
    "wrong": (
        Verdict.WRONG_ANSWER,
        (
            "a, b = map(int, input().split())\nprint(a - b)\n",  # fails the first test
            "a, b = map(int, input().split())\nprint(a + b if a < 9000 else a)\n",  # the last
        ),
    ),
    "too_slow": (Verdict.TIME_LIMIT, ("while True:\n    pass\n",)),
}
MIX = {"correct": 0.6, "wrong": 0.25, "too_slow": 0.15}


def make_problem(tmp: Path) -> str:
    """The a + b problem with NUM_TESTS tests, uploaded; returns its link."""
    tests = [(f"{i * 1000 + 7} {i * 37}\n", f"{i * 1037 + 7}\n") for i in range(NUM_TESTS)]
    problem = write_problem(tmp / "sum", name="a_plus_b", tests=tests)
    repository = TestDataRepository(str(tmp / "repository"), tmp / "upload-cache")
    return repository.upload(problem, "a_plus_b")


def solutions(count: int) -> list[tuple[str, str]]:
    """(kind, response) × count in the MIX proportions, interleaved."""
    kinds = []
    for kind, share in MIX.items():
        kinds += [kind] * max(1, round(count * share))
    kinds = kinds[:count]
    order = sorted(range(len(kinds)), key=lambda i: (i * 7919) % len(kinds))  # fixed shuffle
    out = []
    seen: dict[str, int] = {}
    for i in order:
        kind = kinds[i]
        programs = SOLUTIONS[kind][1]
        program = programs[seen.get(kind, 0) % len(programs)]
        seen[kind] = seen.get(kind, 0) + 1
        out.append((kind, f"Here is my solution.\n```python\n{program}```\n"))
    return out


def start_server(tmp: Path, workers: int, env: dict) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "rlax_tpu",
        "serve",
        "verifier",
        f"--set=verifiers.code_time_limit_s={TIME_LIMIT_S}",
        "--host=127.0.0.1",
        "--port=0",
        f"--num-workers={workers}",
        f"--test-data-cache={tmp / 'cache'}",
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline().strip()
    if not line.startswith("READY "):
        process.kill()
        process.wait()
        raise RuntimeError(f"serve verifier did not start: {line!r}")
    return process, line.split(" ", 1)[1]


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def through_service(client: VerifierClient, link: str, mix: list[tuple[str, str]]) -> dict:
    """Judge `mix` as one call per solution, all in flight at once, then as one batch."""

    def request(tag: str, i: int, response: str) -> VerificationRequest:
        return VerificationRequest(
            kind="code", response=response, problem=link, request_id=f"{tag}/{i}"
        )

    def one(i: int, response: str) -> tuple[float, Verdict]:
        t0 = time.perf_counter()
        (result,) = client.verify([request("single", i, response)], deadline_s=600)
        return time.perf_counter() - t0, result.verdict

    with concurrent.futures.ThreadPoolExecutor(len(mix)) as executor:
        t0 = time.perf_counter()
        futures = [executor.submit(one, i, response) for i, (_, response) in enumerate(mix)]
        single = [f.result() for f in futures]
        single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch = client.verify(
        [request("batch", i, response) for i, (_, response) in enumerate(mix)], deadline_s=600
    )
    batch_s = time.perf_counter() - t0
    by_kind: dict[str, dict] = {}
    unexpected = []
    for (kind, _), (latency, verdict), batched in zip(mix, single, batch, strict=True):
        expected = SOLUTIONS[kind][0]
        row = by_kind.setdefault(kind, {"count": 0, "as_expected": 0, "latencies": []})
        row["count"] += 1
        row["latencies"].append(latency)
        row["as_expected"] += verdict == expected
        for got in (verdict, batched.verdict):
            if got != expected:
                unexpected.append(f"{kind}: {got.value}")
    latencies = [latency for latency, _ in single]
    return {
        "verifications_per_s": len(mix) / single_s,
        "p50_s": percentile(latencies, 50),
        "p95_s": percentile(latencies, 95),
        "batch_verifications_per_s": len(mix) / batch_s,
        "batch_s": batch_s,
        "by_kind": {
            kind: {
                "count": row["count"],
                "as_expected": row["as_expected"],
                "p50_s": percentile(row["latencies"], 50),
                "p95_s": percentile(row["latencies"], 95),
            }
            for kind, row in by_kind.items()
        },
        "unexpected_verdicts": unexpected,
    }


def sandbox_overhead(repeats: int) -> dict:
    """Median wall time of one run of a correct solution on one test: in the sandbox (with
    its per-run cgroup where the host allows one, and with cgroups off), with rlimits only
    (the sandbox's fallback), and as a bare subprocess; interleaved."""
    language = LANGUAGES["python"]
    program = SOLUTIONS["correct"][1][0]
    stdin = b"1007 37\n"
    limits = RunLimits(cpu_time_s=TIME_LIMIT_S)
    sandboxed = Sandbox()
    mode = sandboxed.check()
    no_cgroup = Sandbox(cgroup="off")
    rlimits_only = Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True, cgroup="off")
    cgroup = sandboxed.identity()["cgroup"]
    times: dict[str, list[float]] = {
        "sandboxed": [],
        "no_cgroup": [],
        "rlimits_only": [],
        "bare": [],
    }
    with sandboxed.workdir() as work:
        (work / language.source_name).write_text(program)
        argv = language.run_argv()
        for _ in range(repeats):
            boxes = (
                ("sandboxed", sandboxed),
                ("no_cgroup", no_cgroup),
                ("rlimits_only", rlimits_only),
            )
            for name, box in boxes:
                t0 = time.perf_counter()
                outcome = box.run(argv, workdir=work, limits=limits, stdin=stdin)
                times[name].append(time.perf_counter() - t0)
                assert outcome.ok and outcome.stdout.strip() == b"1044", outcome.describe()
            t0 = time.perf_counter()
            done = subprocess.run(  # the same python3 and environment the sandbox gives
                argv, cwd=work, input=stdin, capture_output=True, check=True, env=SANDBOX_ENV
            )
            times["bare"].append(time.perf_counter() - t0)
            assert done.stdout.strip() == b"1044"
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "sandbox_mode": mode,
        "sandbox_cgroup": cgroup,
        "sandboxed_run_s": medians["sandboxed"],
        "sandboxed_no_cgroup_run_s": medians["no_cgroup"],
        "cgroup_overhead_ratio": medians["sandboxed"] / medians["no_cgroup"],
        "rlimits_only_run_s": medians["rlimits_only"],
        "bare_run_s": medians["bare"],
        "sandbox_overhead_s": medians["sandboxed"] - medians["bare"],
        "repeats": repeats,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 solutions instead of 100")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--workers", type=int, default=2, help="verifier worker count")
    args = parser.parse_args()
    count, repeats = (20, 10) if args.quick else (100, 30)
    token = secrets.token_hex(16)
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=token, JAX_PLATFORMS="cpu")
    mix = solutions(count)
    with tempfile.TemporaryDirectory(prefix="bench-verifier-") as tmp:
        tmp = Path(tmp)
        link = make_problem(tmp)
        server, address = start_server(tmp, args.workers, env)
        try:
            with VerifierClient(address, auth_token=token) as client:
                warm = client.verify(  # fetches the test data, waits for the workers
                    [VerificationRequest(kind="code", response=mix[0][1], problem=link)]
                )
                assert warm[0].verdict != Verdict.VERIFIER_ERROR, warm[0].reason
                results = through_service(client, link, mix)
                metrics = client.metrics()
        finally:
            stop_server(server)
    results.update(sandbox_overhead(repeats))
    results.update(
        solutions=count,
        tests_per_problem=NUM_TESTS,
        time_limit_s=TIME_LIMIT_S,
        workers=args.workers,
        cpus=os.cpu_count(),
        service_p50_s=metrics["latency_p50_s"],
        service_p95_s=metrics["latency_p95_s"],
        verdicts=metrics["verdicts"],
    )
    print(
        f"{count} Python solutions x {NUM_TESTS} tests, {args.workers} workers, "
        f"{os.cpu_count()} CPUs, sandbox: {results['sandbox_mode']}"
    )
    print(f"{'solutions':>10} {'count':>6} {'verdict ok':>11} {'p50 s':>7} {'p95 s':>7}")
    for kind, row in results["by_kind"].items():
        print(
            f"{kind:>10} {row['count']:6d} {row['as_expected']:11d} "
            f"{row['p50_s']:7.3f} {row['p95_s']:7.3f}"
        )
    print(
        f"{'all':>10} {count:6d} {'':>11} {results['p50_s']:7.3f} {results['p95_s']:7.3f}   "
        f"{results['verifications_per_s']:.2f} verifications/s one call each, "
        f"{results['batch_verifications_per_s']:.2f}/s as one batch"
    )
    print(
        f"one run of a correct solution: sandboxed {results['sandboxed_run_s'] * 1e3:.1f} ms, "
        f"rlimits only {results['rlimits_only_run_s'] * 1e3:.1f} ms, bare "
        f"{results['bare_run_s'] * 1e3:.1f} ms -> sandbox overhead "
        f"{results['sandbox_overhead_s'] * 1e3:.1f} ms per run"
    )
    print(
        f"per-run cgroup ({results['sandbox_cgroup']}): sandboxed "
        f"{results['sandboxed_run_s'] * 1e3:.1f} ms vs "
        f"{results['sandboxed_no_cgroup_run_s'] * 1e3:.1f} ms with cgroups off "
        f"-> ratio {results['cgroup_overhead_ratio']:.3f}"
    )
    if args.json:
        results["mfu"] = None
        results["mfu_note"] = "no model compute: verifications of given responses only"
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if results["unexpected_verdicts"]:
        print(f"UNEXPECTED VERDICTS: {results['unexpected_verdicts']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
