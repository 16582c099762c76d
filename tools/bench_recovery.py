#!/usr/bin/env python3
"""Time lost per kill kind, elastic recovery against a full restart, on the tiny e2e job.

    python tools/bench_recovery.py [--kinds inference_worker,verifier,param_server,trainer,
                                    controller] [--after-step 3] [--rounds R]
                                   [--work-dir DIR] [--json OUT]

The job of tests/test_controller_e2e.py (tests/e2e_job.py: the tiny model, 8 off-policy
steps η=2 N=3, two inference workers, a checkpoint and snapshot every 2 steps) runs
once with its SFT warm start, then from that warm start: undisturbed (the baseline), and
for each kind once per mode with one SIGKILL of that component after `--after-step`
consumed steps:

* elastic: the launcher starts the component again and the run goes on
  (`controller.component_restarts` 3); a trainer or controller kill has no elastic mode;
* full restart: `controller.component_restarts` 0, so any death stops the job, and
  `rlax-tpu resume` continues it from its newest snapshot (what every kill cost before
  elastic recovery, and what a trainer or controller kill still costs locally).

Time lost = the disturbed run's wall time (every `run` / `resume` process, including the
wait for the old processes to exit) minus the baseline's, measured in the same round;
every disturbed run must end with the baseline's final digest. R rounds run interleaved
and each figure is the median over rounds (min-max).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the e2e job and its harness

from e2e_job import Job, Kill, Schedule, e2e_config, run_disturbed, summary, write_data  # noqa: E402
from tiny_job import write_config  # noqa: E402

KINDS = {
    "inference_worker": "inference_worker-1",
    "verifier": "verifier-0",
    "param_server": "param_server-0",
    "trainer": "trainer-0",
    "controller": "controller",
}
WORKERS = 2


def warm_start(work: Path, data: Path) -> Path:
    run_dir = work / "warm"
    path = write_config(e2e_config(run_dir, data, workers=WORKERS), work / "warm.json")
    job = Job(["run", str(path)], run_dir)
    try:
        if job.wait(900) != 0:
            raise SystemExit(f"the warm-start run failed:\n{job.output()[-3000:]}")
    finally:
        job.cleanup()
    return run_dir


def one_run(work: Path, data: Path, warm: Path, name: str, kill: Kill | None, restarts: int):
    """(wall seconds, final digest, restarts) of one run from the warm start."""
    run_dir = work / name
    run_dir.mkdir()
    for part in ("checkpoints_warm_start", "tokenizer"):
        shutil.copytree(warm / part, run_dir / part)
    config = e2e_config(run_dir, data, workers=WORKERS, restarts=restarts)
    path = write_config(config, work / f"{name}.json")
    schedule = Schedule(kills=(kill,) if kill else (), failpoints=())
    disturbed = run_disturbed(
        lambda env: Job(["run", str(path)], run_dir, env=env),
        schedule,
        failpoint_dir=work / f"{name}.failpoints",
        timeout_s=900,
    )
    if disturbed.incarnations[-1].returncode != 0 or disturbed.missed:
        raise SystemExit(f"{name} did not finish as planned:\n{disturbed.report()}")
    return disturbed.wall_s, summary(run_dir)["final_digest"], disturbed.restarts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--after-step", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_recovery_"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work / "sums.jsonl")
    t0 = time.monotonic()
    warm = warm_start(work, data)
    print(f"warm start in {time.monotonic() - t0:.0f}s", flush=True)
    runs: dict[tuple[str, str], list[float]] = {}
    baselines: list[float] = []
    for r in range(args.rounds):
        wall, reference, _ = one_run(work, data, warm, f"baseline_{r}", None, 3)
        baselines.append(wall)
        print(f"round {r}: baseline {wall:.1f}s", flush=True)
        for kind in kinds:
            kill = Kill(KINDS[kind], args.after_step)
            modes = ("full",) if kind in ("trainer", "controller") else ("elastic", "full")
            for mode in modes:
                name = f"{kind}_{mode}_{r}"
                wall, digest, restarts = one_run(
                    work, data, warm, name, kill, 3 if mode == "elastic" else 0
                )
                if digest != reference:
                    raise SystemExit(f"{name}: final digest {digest} != baseline {reference}")
                if restarts != (mode == "full"):
                    raise SystemExit(f"{name}: {restarts} restarts, expected {mode == 'full':d}")
                lost = wall - baselines[-1]
                runs.setdefault((kind, mode), []).append(lost)
                print(f"round {r}: {name} {wall:.1f}s (lost {lost:.1f}s)", flush=True)

    def fmt(values: list[float]) -> str:
        med = statistics.median(values)
        return f"{med:6.1f}" + (
            f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
        )

    print()
    print(f"baseline (undisturbed) wall: {fmt(baselines)} s, {args.rounds} round(s)")
    print(f"{'killed':<18} {'elastic lost s':>22} {'full restart lost s':>22} {'elastic/full':>13}")
    rows = []
    for kind in kinds:
        elastic, full = runs.get((kind, "elastic")), runs[(kind, "full")]
        ratio = (
            statistics.median(e / f for e, f in zip(elastic, full, strict=True))
            if elastic
            else None
        )
        print(
            f"{kind:<18} {fmt(elastic) if elastic else '(restart needed)':>22} "
            f"{fmt(full):>22} {f'{ratio:.2f}' if ratio is not None else '-':>13}"
        )
        rows.append({"kind": kind, "elastic_lost_s": elastic, "full_lost_s": full, "ratio": ratio})
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "baseline_s": baselines,
                    "after_step": args.after_step,
                    "rows": rows,
                    "mfu": None,
                    "mfu_note": "no model compute measured: times to recover from a killed "
                    "process (bench_e2e.py measures the run's MFU)",
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
