#!/usr/bin/env python3
"""What the persistent compilation cache saves when a run restarts: the time from starting
`rlax-tpu run` again on a run directory to its first new step, with the cache and without.

    python tools/bench_restart.py [CONFIG] [--rounds R] [--set key=value ...]

Per round and mode (`compilation_cache=auto`: the run directory's compile_cache/; `off`),
a fresh run of the config (default configs/tiny_cpu.py, without its SFT warm start) trains
2 steps, then the same command with one step more restarts it: every component starts and
compiles again (or loads its programs from the cache) and the run trains step 3. The
restart's wall time to its first new step (the console's step line) and until its
components answer are measured; modes alternate within a round. The table gives the median
over rounds and the ratio of the cached restart to the uncached one, measured in the same
run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["trainer.warm_start.steps=0", "controller.eval_dataset=", "controller.num_steps=2"]


def run_until(args: list[str], pattern: str, env: dict[str, str]) -> tuple[float, float, str]:
    """Run `rlax-tpu args` to its end; (seconds until a line matching `pattern`, seconds
    until the components answered, the output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlax_tpu", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    found = ready = float("nan")
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        now = time.perf_counter() - start
        if line.startswith("components ready") and ready != ready:
            ready = now
        if re.search(pattern, line) and found != found:
            found = now
    if proc.wait() != 0:
        raise SystemExit(f"rlax-tpu {' '.join(args)} failed:\n{''.join(lines[-30:])}")
    return found, ready, "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny_cpu.py"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env["JAX_PLATFORMS"] = "cpu"
    times: dict[str, list[tuple[float, float]]] = {"auto": [], "off": []}
    work = Path(tempfile.mkdtemp(prefix="rlax-bench-restart-"))
    try:
        for round_ in range(args.rounds):
            for mode in ("auto", "off") if round_ % 2 == 0 else ("off", "auto"):
                run_dir = work / f"{mode}_{round_}"
                sets = [*BASE, *args.overrides, f"storage.run_dir={run_dir}"]
                sets.append(f"compilation_cache={mode}")
                flags = [x for s in sets for x in ("--set", s)]
                run_until(["run", args.config, *flags], r"^done:", env)
                more = [*flags, "--set", "controller.num_steps=3"]
                first, ready, _ = run_until(["run", args.config, *more], r"^step +3/3", env)
                times[mode].append((first, ready))
                print(
                    f"round {round_} {mode:<4}: first new step after {first:.1f} s "
                    f"(components answered after {ready:.1f} s)",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'cache':<6} {'to first step s':>16} {'components s':>13} {'ratio':>7}")
    base = statistics.median(t for t, _ in times["off"])
    for mode in ("off", "auto"):
        first = statistics.median(t for t, _ in times[mode])
        ready = statistics.median(r for _, r in times[mode])
        print(f"{mode:<6} {first:>16.1f} {ready:>13.1f} {first / base:>7.2f}")


if __name__ == "__main__":
    main()
