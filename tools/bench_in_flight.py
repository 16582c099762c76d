#!/usr/bin/env python3
"""In-flight weight updates end to end: off, resume and keep on a task with heavy-tailed
response lengths, against the simulator's prediction.

    python tools/bench_in_flight.py [--quick] [--rounds R] [--seeds S] [--steps K]
                                    [--target ACC] [--calibration FILE] [--json OUT]
                                    [--work-dir DIR] [--set KEY=VALUE]

The task: the demo's arithmetic (its train and held-out sides, launch/job.py) whose SFT
warm start trains on a worked solution, a lognormal-length run of filler ("thinking")
letters then " = <answer>" (verifiers/tasks.py `with_thinking`, through the dataset's
sft_field), so the warm-started policy's response lengths are heavy-tailed while the
reward stays the answer's. The model is the demo's (configs/tiny_cpu.py; --quick: the
smaller model of tools/bench_e2e.py --quick, a short warm start and a few steps, a smoke
run). Every run is the whole job (launcher, parameter server, trainer, inference workers,
verifiers, controller) at η = 1, N = 4 (J = 3 ticks a response may be carried into), from
one shared SFT warm start, with inference.in_flight_update off, resume and keep. A round
runs every seed's three modes (off first: its final accuracy sets the others' target);
R rounds run interleaved so that a noisy host slows every mode alike. Figures are medians
over rounds and seeds with their min-max, ratios the medians of per-(round, seed) ratios.
docs/controller.md ("Benchmark: in-flight updates on heavy-tailed responses") explains them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_e2e import (  # noqa: E402
    MFU_FIGURES,
    WARMUP_STEPS,
    median,
    mode_mfu,
    num_params,
    ratio,
    spread,
)
from bench_e2e import warm_start as sft_warm_start  # noqa: E402

from rlax_tpu.config import DatasetConfig, RunConfig, load_config  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402
from rlax_tpu.verifiers.tasks import with_thinking, write_jsonl  # noqa: E402

MODES = ("off", "resume", "keep")
IN_FLIGHT = MODES[1:]
RELOAD_EVERY, MAX_STALENESS = 1, 4  # η = 1, N = 4: J = N - η = 3
# What a run directory takes from the warm start: its tokenizer and SFT checkpoint (RL
# starts from its version 0; the task's files live outside the run directories).
WARM_START_FILES = ("tokenizer", "checkpoints_warm_start")
# " = 198" (the largest answer of sums and differences of 0-99) and the EOS token.
ANSWER_TOKENS = 7
# The default target: the off run's final held-out accuracy less this.
TARGET_MARGIN = 0.02


@dataclasses.dataclass(frozen=True)
class Task:
    """The worked solutions' filler length: lognormal with this median and σ, truncated so
    that the whole solution fits `max_new_tokens`."""

    median: float
    sigma: float
    max_new_tokens: int

    @property
    def max_filler(self) -> int:
        return self.max_new_tokens - ANSWER_TOKENS

    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# Full: the demo's model, its 1600-step warm start, 64 new tokens (the filler's median 8,
# p90 about 30, tail to the 57-letter cap; σ 1.4 leaves a fitted σ of about 1.04 after
# the truncation), held-out greedy accuracy every 5 steps on 128
# problems. --quick: bench_e2e's quick model (64 wide, 2 layers), a short warm start, 32
# new tokens, a handful of steps: a smoke run of the whole benchmark, not a measurement.
TASKS = {
    "full": Task(median=8.0, sigma=1.4, max_new_tokens=64),
    "quick": Task(median=4.0, sigma=1.4, max_new_tokens=32),
}
COMMON = [
    "trainer.optimizer.learning_rate=1e-4",  # bench_e2e's RL rate
    f"staleness.reload_every={RELOAD_EVERY}",
    f"staleness.max_staleness={MAX_STALENESS}",
    "staleness.schedule=deterministic",
    "inference.max_prompt_len=48",  # the task's prompts are 46 tokens with the template
    # Prompts are admitted into free slots 16 rows a prefill call, not the demo's 64: with
    # long tails (and continuations) slots free a few at a time, and a 64-row call computes
    # its padded rows too. One 12-step pass each, 2026-11-29: off 0.33 -> 0.44 steps/s, keep
    # 0.28 -> 0.62, resume 0.23 -> 0.46 (64 -> 16 rows; a busy host, 100-step warm starts
    # of filler σ 1.25 then 1.4).
    "inference.prefill_batch_size=16",
    # Room for every mode's live and parked sequences: KV pressure is not what is measured.
    "inference.kv_cache_bytes=33554432",
]
FULL = ["controller.num_steps=60", "controller.eval_every=5", "controller.eval_size=128"]
QUICK = [
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.head_dim=16",
    "trainer.warm_start.steps=60",
    "controller.num_steps=6",
    "controller.eval_every=3",
    "controller.eval_size=32",
]

# A mode's figures summarised as medians over rounds and seeds.
MEDIAN_FIGURES = (
    "generation_tokens_per_s",
    "tokens_per_s",
    "steps_per_s",
    "worker_idle_fraction",
    "trainer_idle_fraction",
    "partial_fraction",
    "version_span_mean",
    "response_tokens_mean",
    "final_accuracy",
    "time_to_accuracy_s",
    "wall_s",
    *MFU_FIGURES,
)


# -- the task ------------------------------------------------------------------------------------
def write_task(work: Path, task: Task) -> tuple[Path, Path]:
    """The task's training rows (with their worked solutions) and held-out rows, written once
    under work/task-<key>/ (named by the task, so a warm start keyed by the path is of these
    rows): (train.jsonl, heldout.jsonl)."""
    from rlax_tpu.launch.job import arithmetic_split

    directory = work / f"task-{task.key()}"
    train, heldout = directory / "train.jsonl", directory / "heldout.jsonl"
    if not train.exists():
        rows = arithmetic_split(0, "train")
        write_jsonl(
            train,
            with_thinking(
                rows, 0, median=task.median, sigma=task.sigma, max_filler=task.max_filler
            ),
        )
    if not heldout.exists():
        rows = arithmetic_split(0, "heldout")
        write_jsonl(heldout, [{**r, "verifier": "arithmetic"} for r in rows])
    return train, heldout


def bench_config(
    quick: bool, work: Path, train: Path, heldout: Path, steps: int | None, extra: Sequence[str]
) -> RunConfig:
    """The benchmark's config (in_flight_update off, seed 0): the demo's, COMMON and FULL or
    QUICK, the task's lengths and files, `steps`, then `extra`. Every run keeps compiled
    programs in work/compile_cache: a round's first run compiles what the others load."""
    task = TASKS["quick" if quick else "full"]
    prompt_len = 48
    config = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    dataset = DatasetConfig(path=str(train), verifier="arithmetic", sft_field="solution")
    config = dataclasses.replace(
        config,
        controller=dataclasses.replace(
            config.controller, datasets=(dataset,), eval_dataset=str(heldout)
        ),
    )
    overrides = [
        *COMMON,
        *(QUICK if quick else FULL),
        f"inference.max_new_tokens={task.max_new_tokens}",
        f"trainer.max_seq_len={prompt_len + task.max_new_tokens}",
        *([f"controller.num_steps={steps}"] if steps is not None else []),
        f"compilation_cache={work / 'compile_cache'}",
        *extra,
    ]
    return config.apply_overrides(overrides)


def mode_config(config: RunConfig, mode: str, seed: int, run_dir: Path) -> RunConfig:
    return config.apply_overrides(
        [
            f"name=bench_in_flight_{mode}_s{seed}",
            f"seed={seed}",
            f"inference.in_flight_update={mode}",
            f"storage.run_dir={run_dir}",
        ]
    )


# -- one run -------------------------------------------------------------------------------------
def run_mode(config: RunConfig, warm: Path, log: Path, peak_flops: float | None = None) -> dict:
    """The whole job of `config` in a fresh run directory holding a copy of the warm start,
    its output to `log`: its figures (MFU against `peak_flops`)."""
    from rlax_tpu.launch import job

    run_dir = Path(config.storage.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a left-over run dir would resume
    run_dir.mkdir(parents=True)
    for item in WARM_START_FILES:
        shutil.copytree(warm / item, run_dir / item)
    with open(log, "w") as out, contextlib.redirect_stdout(out):
        summary = job.run(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return figures(summary, rows, config.controller.global_batch_size, config, peak_flops)


def figures(
    summary: dict,
    rows: list[dict],
    batch_size: int,
    config: RunConfig | None = None,
    peak_flops: float | None = None,
) -> dict:
    """A run's figures from the controller's summary and its metrics.jsonl rows, of batches
    of `batch_size` responses (a row's response_tokens is its batch's sum), of `config`
    (None: no MFU figures).

    Throughput is over the warm steps (after the first WARMUP_STEPS, whose compiles would
    dominate), held-out evaluations taken out: generated tokens (the trained batches'
    response tokens) per second of generation (the workers' Generate calls, summed) and per
    second of run wall time. Step s's row has elapsed_s taken before its evaluation; the
    summary's eval_elapsed_s[s] is when that evaluation finished. MFU: bench_e2e's
    (`mode_mfu`: a warm step's model FLOPs at steps/s over `peak_flops`).
    """
    rows = [r for r in rows if "reward_mean" in r]  # training steps (not the step-0 eval)
    elapsed = {r["step"]: r["elapsed_s"] for r in rows}
    evals = {int(s): a for s, a in summary["evals"].items()}
    finished = {int(s): t for s, t in summary["eval_elapsed_s"].items()}
    eval_s = {s: finished[s] - elapsed.get(s, 0.0) for s in finished}
    last = max(elapsed)
    warm_rows = [r for r in rows if r["step"] > WARMUP_STEPS]
    warm_s = elapsed[last] - elapsed[WARMUP_STEPS]
    warm_s -= sum(d for s, d in eval_s.items() if WARMUP_STEPS <= s < last)
    tokens = sum(r["response_tokens"] for r in warm_rows)
    generate_s = sum(r.get("time/worker_generate_s", 0.0) for r in warm_rows)
    spans = [r.get("rollout/version_span", 0) for r in rows]
    steps_per_s = round((last - WARMUP_STEPS) / warm_s, 3)
    return {
        "steps": summary["end_step"] - summary["start_step"],
        "steps_per_s": steps_per_s,
        "generated_tokens": tokens,
        "generation_s": round(generate_s, 2),
        "generation_tokens_per_s": round(tokens / generate_s, 1) if generate_s else None,
        "tokens_per_s": round(tokens / warm_s, 1),
        "response_tokens_mean": round(
            statistics.mean(r["response_tokens"] for r in rows) / batch_size, 2
        ),
        "worker_idle_fraction": round(summary["worker_idle_fraction"], 3),
        "trainer_idle_fraction": round(summary["trainer_idle_fraction"], 3),
        "partial_fraction": round(
            statistics.mean(r.get("rollout/partial_fraction", 0.0) for r in rows), 3
        ),
        "version_span_mean": round(statistics.mean(spans), 3),
        "version_span_max": max(spans),
        "continued": summary.get("continued", 0),
        "staleness_mean": round(summary["staleness_mean"], 3),
        "wall_s": round(summary["wall_s"], 1),
        "eval_s": round(sum(eval_s.values()), 1),
        "evals": {str(s): evals[s] for s in sorted(evals)},
        "eval_finished_s": {str(s): round(finished[s], 1) for s in sorted(finished)},
        "initial_accuracy": evals.get(0),
        "final_accuracy": evals[max(evals)] if evals else None,
        **mode_mfu(warm_rows, config, steps_per_s, peak_flops),
    }


def time_to_accuracy(run: dict, target: float | None) -> tuple[float | None, int | None]:
    """(seconds from the start of RL to the end of the first held-out evaluation after a
    step at or above `target`, its step); (None, None) when none reached it. The warm
    start's own evaluation (step 0) does not count: a target it meets is met at the first
    evaluation of RL."""
    if target is None:
        return None, None
    for step in sorted(int(s) for s in run["evals"] if int(s) > 0):
        if run["evals"][str(step)] >= target - 1e-9:
            return run["eval_finished_s"][str(step)], step
    return None, None


# -- the response lengths ------------------------------------------------------------------------
def length_distribution(lengths: Sequence[int], max_new_tokens: int) -> dict | None:
    """median, p90, max, mean, the fitted σ of log length (the lognormal's maximum
    likelihood shape: the standard deviation of ln length, over the lengths above 0) and
    the fraction at `max_new_tokens` or more, of `lengths` (tokens); None for none."""
    if not lengths:
        return None
    ordered = sorted(lengths)
    logs = [math.log(n) for n in ordered if n > 0] or [0.0]
    return {
        "count": len(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)],
        "max": ordered[-1],
        "mean": round(statistics.mean(ordered), 2),
        "sigma_log": round(statistics.pstdev(logs), 3),
        "at_max_new_tokens": round(sum(n >= max_new_tokens for n in ordered) / len(ordered), 3),
    }


def rollout_lengths(
    run_dir: Path, *, version: int | None = None, last: int = 0
) -> tuple[list[int], list[int]]:
    """(response lengths in tokens, stop token included; filler lengths, of the responses
    that reached " = ") of the run's logged rollouts: those generated with `version` (0:
    the warm-started policy), or those of the `last` batches."""
    from rlax_tpu.controller.snapshots import RolloutLog
    from rlax_tpu.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(str(run_dir / "tokenizer"))
    log = RolloutLog(str(run_dir))
    batches = log.batches()
    if last:
        batches = batches[-last:]
    lengths, fillers = [], []
    for batch in batches:
        for record in log.rollouts(batch).values():
            if version is None or (record.version == version and record.token_versions is None):
                lengths.append(len(record.tokens))
                text = tokenizer.decode(list(record.tokens), skip_special_tokens=True)
                if " = " in text:
                    fillers.append(text.rindex(" = "))
    return lengths, fillers


def sft_target_lengths(train: Path) -> tuple[list[int], list[int]]:
    """(the warm start's target lengths in tokens: a character each, and EOS; their filler
    lengths)."""
    with open(train) as f:
        solutions = [json.loads(line)["solution"] for line in f if line.strip()]
    return [len(s) + 1 for s in solutions], [s.rindex(" = ") for s in solutions]


# -- the simulator's prediction ------------------------------------------------------------------
def predict(config: RunConfig, calibration: Sequence[str], lengths: Sequence[int]) -> dict:
    """The simulator's in-flight comparison for each mode of IN_FLIGHT against off, on this
    config, with the measured response lengths (an empirical distribution) and the timings
    of the `calibration` files (tools/bench_*.py JSON; none: its uncalibrated defaults)."""
    from rlax_tpu.cli.simulate import simulate_config
    from rlax_tpu.simulator import Calibration, CalibrationError

    out: dict[str, Any] = {}
    for mode in IN_FLIGHT:
        calibrated = Calibration()
        try:
            for path in calibration:
                calibrated.add_file(path)
            if lengths:
                calibrated.add_settings(
                    {
                        "response_tokens": {
                            "kind": "empirical",
                            "values": [float(n) for n in lengths],
                        }
                    }
                )
            simulation = simulate_config(
                config.override("inference.in_flight_update", mode), calibrated
            )
        except CalibrationError as e:
            return {"error": str(e)}
        comparison = simulation.figures.get("in_flight")
        if comparison is None:
            out[mode] = None
            continue
        out[mode] = {
            "steps_per_s": comparison["steps_per_s"]["ratio"],
            "generation_tokens_per_s": comparison["generation_tokens_per_s"]["ratio"],
            "worker_idle_fraction": {
                "off": comparison["worker_idle_fraction"]["off"],
                mode: comparison["worker_idle_fraction"][mode],
            },
        }
        out["notes"] = simulation.figures["notes"]
    out["calibrated"] = bool(calibration)
    return out


# -- over rounds and seeds -----------------------------------------------------------------------
def summarise(runs: list[dict], mode: str) -> dict:
    """One mode's figures over its runs (every round and seed): each figure's median, its
    [min, max] in `min_max`, and how many runs reached their target."""
    mine = [r for r in runs if r["mode"] == mode]
    out: dict[str, Any] = {"runs": len(mine)}
    ranges = {}
    for key in MEDIAN_FIGURES:
        values = [r["figures"].get(key) for r in mine]
        slowest = key == "time_to_accuracy_s"  # a target not reached: slower than any
        digits = None if key in MFU_FIGURES else 4  # an MFU of a few per cent keeps its digits
        out[key] = median(values, missing_is_slowest=slowest, digits=digits)
        ranges[key] = spread(values)
    out["version_span_max"] = max(r["figures"]["version_span_max"] for r in mine)
    out["target_reached"] = sum(r["figures"]["time_to_accuracy_s"] is not None for r in mine)
    out["min_max"] = ranges
    return out


def stat(values: Sequence[float | None]) -> dict[str, float | None]:
    """{median, min, max} of the values present (None when there are none)."""
    bounds = spread(values)
    return {
        "median": median(values),
        "min": bounds[0] if bounds else None,
        "max": bounds[1] if bounds else None,
    }


def speedups(runs: list[dict]) -> dict[str, dict]:
    """Per in-flight mode, its ratios to the off run of the same round and seed: throughput
    (tokens per second of run wall time), generation throughput (tokens per generation
    second), steps/s, and time to accuracy (off's time over the mode's)."""
    off = {(r["round"], r["seed"]): r["figures"] for r in runs if r["mode"] == "off"}
    out = {}
    for mode in IN_FLIGHT:
        pairs = [
            (off[(r["round"], r["seed"])], r["figures"])
            for r in runs
            if r["mode"] == mode and (r["round"], r["seed"]) in off
        ]
        out[mode] = {
            "throughput": stat([ratio(m["tokens_per_s"], o["tokens_per_s"]) for o, m in pairs]),
            "generation_throughput": stat(
                [
                    ratio(m["generation_tokens_per_s"], o["generation_tokens_per_s"])
                    for o, m in pairs
                ]
            ),
            "steps_per_s": stat([ratio(m["steps_per_s"], o["steps_per_s"]) for o, m in pairs]),
            "time_to_accuracy": stat(
                [ratio(o["time_to_accuracy_s"], m["time_to_accuracy_s"]) for o, m in pairs]
            ),
        }
    return out


def accuracy_deltas(runs: list[dict], seeds: Sequence[int]) -> dict[str, dict]:
    """Per in-flight mode, its final held-out accuracy less off's, per seed (each the median
    over rounds: a seed's rounds differ only in timing), and their mean over seeds."""

    def final(mode: str, seed: int) -> float | None:
        return median(
            [r["figures"]["final_accuracy"] for r in runs if (r["mode"], r["seed"]) == (mode, seed)]
        )

    out = {}
    for mode in IN_FLIGHT:
        per_seed = {}
        for seed in seeds:
            a, b = final(mode, seed), final("off", seed)
            per_seed[str(seed)] = None if a is None or b is None else round(a - b, 4)
        present = [d for d in per_seed.values() if d is not None]
        out[mode] = {
            "mean": round(statistics.mean(present), 4) if present else None,
            "per_seed": per_seed,
        }
    return out


# -- the table -----------------------------------------------------------------------------------
def _cell(value: float | None, bounds: list[float] | None, fmt: str) -> str:
    if value is None:
        return "n/a"
    text = fmt.format(value)
    if bounds is None or bounds[0] == bounds[1]:
        return text
    return f"{text} [{fmt.format(bounds[0])}–{fmt.format(bounds[1])}]"


def _stat(s: dict, fmt: str = "{:.2f}x") -> str:
    return _cell(s["median"], [s["min"], s["max"]] if s["min"] is not None else None, fmt)


COLUMNS = (
    ("gen tok/s", "generation_tokens_per_s", "{:.0f}"),
    ("tok/s (wall)", "tokens_per_s", "{:.0f}"),
    ("steps/s", "steps_per_s", "{:.2f}"),
    ("MFU", "mfu", "{:.2%}"),
    ("worker idle", "worker_idle_fraction", "{:.2f}"),
    ("partial", "partial_fraction", "{:.2f}"),
    ("span", "version_span_mean", "{:.2f}"),
    ("final acc", "final_accuracy", "{:.3f}"),
    ("to acc s", "time_to_accuracy_s", "{:.0f}"),
)


def print_table(report: dict) -> None:
    print()
    print(
        f"{report['device']}, {report['model_params'] / 1e6:.2f}M parameters, "
        f"{report['steps']} RL steps ({WARMUP_STEPS} warm-up), η={RELOAD_EVERY} "
        f"N={MAX_STALENESS} (J={MAX_STALENESS - RELOAD_EVERY}), max_new_tokens "
        f"{report['max_new_tokens']}, tick_tokens {report['tick_tokens']}; "
        f"{report['num_rounds']} round(s) x {len(report['seeds'])} seed(s): medians [min–max]"
    )
    width = max(len(c[0]) for c in COLUMNS) + 10
    print(f"{'':<8}" + "".join(f"{title:>{width}}" for title, _, _ in COLUMNS))
    for mode in MODES:
        m = report["modes"][mode]
        cells = [_cell(m[key], m["min_max"][key], fmt) for _, key, fmt in COLUMNS]
        if m["target_reached"] < m["runs"]:
            cells[-1] += f" {m['target_reached']}/{m['runs']}"
        print(f"{mode:<8}" + "".join(f"{c:>{width}}" for c in cells))
    sim = report["simulator"]
    label = "calibrated" if sim.get("calibrated") else "uncalibrated"
    print(f"in flight vs off: measured (median [min–max] of per-run ratios) | simulator ({label})")
    for mode in IN_FLIGHT:
        s = report["speedup_in_flight_vs_off"][mode]
        predicted = sim.get(mode) or {}
        acc = report["accuracy_delta_vs_off"][mode]
        per_seed = ", ".join("n/a" if d is None else f"{d:+.3f}" for d in acc["per_seed"].values())
        mean = "n/a" if acc["mean"] is None else f"{acc['mean']:+.3f}"
        print(
            f"  {mode}: throughput {_stat(s['throughput'])}, steps/s {_stat(s['steps_per_s'])}, "
            f"gen tok/s {_stat(s['generation_throughput'])}, time to accuracy "
            f"{_stat(s['time_to_accuracy'])} | simulator steps/s "
            f"{_fmt_ratio(predicted.get('steps_per_s'))}, tok/s "
            f"{_fmt_ratio(predicted.get('generation_tokens_per_s'))}; accuracy vs off "
            f"{mean} (per seed {per_seed})"
        )
    if "error" in sim:
        print(f"  simulator: {sim['error']}")
    for name, d in report["response_lengths"].items():
        if d is None:
            continue
        filler = report["filler_lengths"][name]
        print(
            f"response tokens, {name} ({d['count']}): median {d['median']}, p90 {d['p90']}, "
            f"max {d['max']}, mean {d['mean']}, σ of log length {d['sigma_log']}, "
            f"{d['at_max_new_tokens']:.1%} at max_new_tokens"
            + (
                ""
                if filler is None
                else f"; filler median {filler['median']}, p90 {filler['p90']}, "
                f"σ of log {filler['sigma_log']}"
            )
        )
    print(
        "gen tok/s: generated tokens per second of the workers' Generate calls; tok/s (wall): "
        "per second of run time; both over the warm steps, evaluations out. partial: rows of "
        "more than one version; span: newest − oldest token version in a batch. to acc s: "
        "RL start to the end of the first held-out evaluation at the target (off's final "
        f"accuracy − {TARGET_MARGIN:.2f} in its round and seed, unless --target). MFU: a "
        "warm step's model FLOPs (update and generation, tools/bench_e2e.py's count) x "
        "steps/s over this process's measured matmul peak."
    )


def _fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


# -- the run ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (about 2 minutes)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="RL seeds 0..S-1, each mode run with each, from one warm start (default "
        "%(default)s; learning quality needs 3)",
    )
    parser.add_argument("--steps", type=int, help="RL steps (default 60; --quick 6)")
    parser.add_argument(
        "--target",
        type=float,
        help="held-out accuracy for the time to accuracy (default: the off run's final "
        f"accuracy − {TARGET_MARGIN}, per round and seed)",
    )
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="FILE",
        help="a tools/bench_*.py --json output for the simulator's timings (repeatable; "
        "none: its uncalibrated defaults)",
    )
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="run directories go here (kept; a finished SFT warm start here is reused); "
        "default: a temporary directory, removed at the end unless the run fails",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seeds < 1:
        parser.error(f"--rounds and --seeds must be at least 1, got {args.rounds}, {args.seeds}")
    if args.steps is not None and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps {args.steps} leaves no step after the {WARMUP_STEPS} warm-up")
    for path in args.calibration:
        if not Path(path).is_file():
            parser.error(f"--calibration {path}: no such file")

    temporary = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="bench_in_flight_")) if temporary else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    task = TASKS["quick" if args.quick else "full"]
    train, heldout = write_task(work, task)
    config = bench_config(args.quick, work, train, heldout, args.steps, args.set)
    configure_jax(config)  # before anything starts JAX: the SFT warm start runs here
    from rlax_tpu.trainer import perf

    peak_flops = perf.devices_peak_flops(config.model.dtype)  # before any job runs
    seeds = list(range(args.seeds))
    print(f"work dir {work}", flush=True)
    print(
        f"{num_params(config) / 1e6:.2f}M parameters; SFT warm start "
        f"({config.trainer.warm_start.steps} steps) on worked solutions (filler median "
        f"{task.median}, σ {task.sigma}, at most {task.max_filler})",
        flush=True,
    )
    t_start = time.perf_counter()
    runs: list[dict] = []
    try:
        warm, sft_s, reused = sft_warm_start(config, work, work / "warm_start.log")
        print(f"warm start {'reused' if reused else 'ready'} in {sft_s:.0f}s: {warm}", flush=True)
        for r in range(args.rounds):
            for seed in seeds:
                target = args.target
                for mode in MODES:
                    t0 = time.perf_counter()
                    run_dir = work / f"s{seed}-{mode}"
                    cfg = mode_config(config, mode, seed, run_dir)
                    log = work / f"round{r + 1}-s{seed}-{mode}.log"
                    figs = run_mode(cfg, warm, log, peak_flops)
                    if mode == "off" and r == 0:  # the policy's lengths, sampled
                        figs["lengths_warm_start"] = rollout_lengths(run_dir, version=0)
                        figs["lengths_final"] = rollout_lengths(run_dir, last=MAX_STALENESS)
                    if target is None and mode == "off" and figs["final_accuracy"] is not None:
                        target = round(figs["final_accuracy"] - TARGET_MARGIN, 4)
                    figs["target"] = target
                    figs["time_to_accuracy_s"], figs["steps_to_accuracy"] = time_to_accuracy(
                        figs, target
                    )
                    runs.append({"round": r + 1, "seed": seed, "mode": mode, "figures": figs})
                    _progress(r, args.rounds, seed, mode, figs, time.perf_counter() - t0)
    except BaseException:
        print(f"failed; the run directories and logs are kept in {work}", file=sys.stderr)
        raise

    import jax

    lengths: dict[str, tuple[list[int], list[int]]] = {"sft_targets": sft_target_lengths(train)}
    for name in ("warm_start", "final"):
        found = [
            run["figures"].pop(f"lengths_{name}", None) for run in runs if run["mode"] == "off"
        ]
        found = [f for f in found if f is not None]
        lengths[f"{name}_policy"] = (
            [n for tokens, _ in found for n in tokens],
            [n for _, fillers in found for n in fillers],
        )
    report = {
        "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "cpu_count": os.cpu_count(),
        "quick": args.quick,
        "num_rounds": args.rounds,
        "seeds": seeds,
        "steps": config.controller.num_steps,
        "model_params": num_params(config),
        "prompts_per_batch": config.controller.prompts_per_batch,
        "samples_per_prompt": config.controller.samples_per_prompt,
        "reload_every": RELOAD_EVERY,
        "max_staleness": MAX_STALENESS,
        "max_new_tokens": config.inference.max_new_tokens,
        "tick_tokens": _tick_tokens(config),
        "eval_every": config.controller.eval_every,
        "eval_size": config.controller.eval_size,
        "task": {**dataclasses.asdict(task), "max_filler": task.max_filler},
        "sft_steps": config.trainer.warm_start.steps,
        "sft_s": round(sft_s, 1),
        "sft_reused": reused,
        "target": args.target,
        # Sampled responses of the off runs' first round: of version 0 (the warm-started
        # policy) and of the last batches; the filler: the letters before " = ".
        "response_lengths": {
            name: length_distribution(tokens, task.max_new_tokens)
            for name, (tokens, _) in lengths.items()
        },
        "filler_lengths": {
            name: length_distribution(fillers, task.max_filler)
            for name, (_, fillers) in lengths.items()
        },
        "modes": {mode: summarise(runs, mode) for mode in MODES},
        "speedup_in_flight_vs_off": speedups(runs),
        "accuracy_delta_vs_off": accuracy_deltas(runs, seeds),
        "simulator": predict(config, args.calibration, lengths["warm_start_policy"][0]),
        "runs": runs,
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if temporary:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _tick_tokens(config: RunConfig) -> int:
    """The tick_tokens the in-flight runs use (InFlightPlan's default when it is 0)."""
    from rlax_tpu.staleness import InFlightPlan, StalenessPolicy

    resume = config.override("inference.in_flight_update", "resume")
    plan = InFlightPlan.of(resume, StalenessPolicy.from_config(resume.staleness))
    return plan.tick_tokens if plan else 0


def _progress(r: int, rounds: int, seed: int, mode: str, m: dict, seconds: float) -> None:
    acc = m["final_accuracy"]
    print(
        f"[round {r + 1}/{rounds} seed {seed}] {mode}: {m['steps']} steps in {seconds:.0f}s, "
        f"{m['tokens_per_s']:.0f} tok/s, {m['steps_per_s']:.2f} steps/s, worker idle "
        f"{m['worker_idle_fraction']:.2f}, partial {m['partial_fraction']:.2f}, held-out "
        f"{m['initial_accuracy']} -> {acc}, target {m['target']} at "
        f"{m['time_to_accuracy_s']} s",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
