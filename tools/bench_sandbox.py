#!/usr/bin/env python3
"""What the sandbox's seccomp filter and its own PID 1 cost per run, against a run without them.

    python tools/bench_sandbox.py [--runs N] [--json OUT]

Three configurations of the same `Sandbox.run` (launcher, uid switch, per-run cgroup where
the host allows, bwrap), interleaved run by run (their order rotating every round) so that
they share the machine's state:

* baseline:  bwrap's own init as the sandbox's PID 1, no seccomp filter (the sandbox before
             issue 35);
* filter:    the same with the seccomp filter (seccomp.py);
* shipped:   the filter and sandbox_init.py as PID 1 (what runs now).

on three programs: `true` (the fixed cost of a run), a Python program that makes 200k cheap
system calls (the filter's cost per call: every call runs the filter's ~60 comparisons), and
a Python program that computes for about 0.1 s (a typical test). The table gives the median
wall time per run (min-max) and its ratio to the baseline's median, measured in the same
run. The figures in docs/verifiers.md were measured with this tool.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlax_tpu.verifiers import sandbox as sandbox_module  # noqa: E402
from rlax_tpu.verifiers.sandbox import RunLimits, Sandbox  # noqa: E402

PROGRAMS = {
    "true": ["true"],
    "200k syscalls": [
        "python3",
        "-I",
        "-S",
        "-c",
        "import os\nfor _ in range(200_000): os.getppid()",
    ],
    "0.1 s compute": ["python3", "-I", "-S", "-c", "print(sum(i * i for i in range(1_500_000)))"],
}
CONFIGURATIONS = ("baseline", "filter", "shipped")


@contextlib.contextmanager
def configured(name: str) -> Iterator[None]:
    """Runs made inside are made the way configuration `name` says."""
    if name == "shipped":
        yield
        return
    original_filter = sandbox_module._seccomp_filter
    original_argv = sandbox_module.bwrap_argv
    original_init = sandbox_module._INIT_ARGV

    @contextlib.contextmanager
    def no_filter(*, required: bool) -> Iterator[None]:
        yield None

    def bwraps_init(*args, **kwargs) -> list[str]:
        return [a for a in original_argv(*args, **kwargs) if a != "--as-pid-1"]

    try:
        if name == "baseline":
            sandbox_module._seccomp_filter = no_filter
        sandbox_module.bwrap_argv = bwraps_init
        sandbox_module._INIT_ARGV = []
        yield
    finally:
        sandbox_module._seccomp_filter = original_filter
        sandbox_module.bwrap_argv = original_argv
        sandbox_module._INIT_ARGV = original_init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per cell (default 30)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    sandbox = Sandbox()
    print(f"sandbox: {sandbox.check()}", flush=True)
    limits = RunLimits(cpu_time_s=5.0)
    times: dict[tuple[str, str], list[float]] = {}
    with sandbox.workdir() as work:
        for round_ in range(args.runs):
            # The order rotates every round: no configuration always runs first.
            shift = round_ % len(CONFIGURATIONS)
            order = CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]
            for program, argv in PROGRAMS.items():
                for name in order:
                    with configured(name):
                        start = time.perf_counter()
                        outcome = sandbox.run(argv, workdir=work, limits=limits)
                        elapsed = time.perf_counter() - start
                    if not outcome.ok:
                        raise SystemExit(f"{program} under {name}: {outcome.describe()}")
                    times.setdefault((program, name), []).append(elapsed)
    rows = []
    print(
        f"\n{'program':<15} {'configuration':<10} {'median ms':>10} {'min-max ms':>16} {'ratio':>6}"
    )
    for program in PROGRAMS:
        base = statistics.median(times[(program, "baseline")])
        for name in CONFIGURATIONS:
            values = times[(program, name)]
            median = statistics.median(values)
            row = {
                "program": program,
                "configuration": name,
                "median_ms": 1000 * median,
                "min_ms": 1000 * min(values),
                "max_ms": 1000 * max(values),
                "ratio": median / base,
            }
            rows.append(row)
            print(
                f"{program:<15} {name:<10} {row['median_ms']:>10.1f} "
                f"{row['min_ms']:>7.1f}-{row['max_ms']:<8.1f} {row['ratio']:>6.3f}"
            )
    if args.json:
        note = "no model compute: sandboxed program runs only"
        figures = {"runs": args.runs, "rows": rows, "mfu": None, "mfu_note": note}
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
