#!/usr/bin/env python3
"""Does a config learn, in every seed and staleness mode? Held-out accuracy curves with spread.

    python tools/learning_curves.py [CONFIG] [--quick] [--seeds 0,1,2]
        [--modes on_policy,one_step_off_policy,off_policy] [--json OUT] [--plot OUT.png]
        [--work-dir DIR] [--set key=value ...]

For each seed the config (default configs/tiny_cpu.py, the Quickstart demo) is warm-started
by SFT once; then, from those weights, the whole job (`rlax_tpu.launch.job.run`:
launcher, parameter server, trainer, inference worker, verifiers, controller) runs its RL
phase once per mode:

* on_policy: η = 1, N = 0 (configs/tiny_cpu.py);
* one_step_off_policy: η = 1, N = 1 (configs/tiny_cpu_one_step_off_policy.py);
* off_policy: η = 1, N = 4 (configs/tiny_cpu_off_policy.py; RLAX's pod setting η = 16,
  N = 32 is longer than the demo's run).

Each run's held-out greedy accuracy at every evaluation (`controller.eval_every`, on
`controller.eval_size` prompts, with its 95 % Wilson interval) is read from its
metrics.jsonl, with the trainer's per-step diagnostics (reward, policy entropy, k3 KL to the
SFT reference when `trainer.algorithm.kl.log_reference` is on, clip fraction,
zero-variance group fraction, gradient norm), and the final policy's KL to the SFT model
(nats per response, as tools/staleness_sweep.py measures it). The report
gives, per mode, the curve's mean over seeds with its min–max band, and per run the two
criteria the demo is held to (docs/learning.md):

* gain: final accuracy minus the SFT start (at least `--min-gain`, default 0.10);
* late drop: the largest fall of an evaluation below the one before it, over evaluations
  after the first quarter of the run (at most `--max-drop`, default 0.05).

It prints a markdown table, writes every figure to --json and the curves to --plot (needs
matplotlib: `pip install -e .[plots]`), and exits 1 when a run misses a criterion (0 with
--no-check). Runs are kept under --work-dir and reused when their config is unchanged, so
an interrupted report continues. `--quick` is a smoke test: a smaller model, two seeds,
two modes and a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from staleness_sweep import kl_to_reference, start_from_warm_start, warm_start  # noqa: E402

from rlax_tpu.config import RunConfig, StalenessConfig, load_config  # noqa: E402
from rlax_tpu.controller.evaluation import wilson_interval  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402

MODES = {
    "on_policy": StalenessConfig(reload_every=1, max_staleness=0),
    "one_step_off_policy": StalenessConfig(reload_every=1, max_staleness=1),
    "off_policy": StalenessConfig(reload_every=1, max_staleness=4),
}
LABELS = {"on_policy": "on-policy", "one_step_off_policy": "one-step", "off_policy": "off-policy"}
SEEDS = (0, 1, 2)
QUICK_SEEDS = (0, 1)
QUICK_MODES = ("on_policy", "off_policy")
# The trainer's per-step figures kept per run (metrics.jsonl names, "train/" left out).
DIAGNOSTICS = (
    "reward_mean",
    "train/entropy",
    "train/kl",
    "train/clip_fraction",
    "train/zero_variance_group_fraction",
    "train/grad_norm",
    "train/learning_rate",
)
QUICK = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=1",
    "model.head_dim=16",
    "trainer.warm_start.steps=2",
    "controller.num_steps=2",
    "controller.eval_every=1",
    "controller.eval_size=16",
]
MIN_GAIN = 0.10
MAX_DROP = 0.05


# -- one run ---------------------------------------------------------------------------------------
def run_config(base: RunConfig, mode: str, run_dir: Path) -> RunConfig:
    return dataclasses.replace(
        base,
        name=f"{base.name}_{mode}",
        staleness=MODES[mode],
        storage=dataclasses.replace(base.storage, run_dir=str(run_dir)),
    )


def read_curve(run_dir: Path) -> dict[str, Any]:
    """The evaluations and per-step diagnostics in a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {}  # step -> accuracy (a resumed run may log a step twice: the last one holds)
    diagnostics: dict[str, dict[int, float]] = {name: {} for name in DIAGNOSTICS}
    for row in rows:
        if "eval_accuracy" in row:
            evals[int(row["step"])] = row["eval_accuracy"]
        for name in DIAGNOSTICS:
            if name in row:
                diagnostics[name][int(row["step"])] = row[name]
    steps = sorted(evals)
    return {
        "eval_steps": steps,
        "accuracy": [evals[s] for s in steps],
        "diagnostics": {
            name: {"steps": sorted(v), "values": [v[s] for s in sorted(v)]}
            for name, v in diagnostics.items()
            if v
        },
    }


def final_kl(run_dir: Path, warm: Path) -> dict[str, float]:
    """KL(π_θ‖π_SFT) of the run's final version in nats per response, measured as
    tools/staleness_sweep.py does (responses sampled from the final policy on the held-out
    prompts, the exact per-token KL summed along each)."""
    kl = kl_to_reference(run_dir, str(warm / "sft_model"))
    return {"kl_to_reference": kl["kl"], "kl_to_reference_stderr": kl["kl_stderr"]}


def run_one(base: RunConfig, mode: str, warm: Path, work: Path) -> dict[str, Any]:
    """The whole job for `mode` from the warm start, and its curve (reused from a finished
    run of the same config)."""
    from rlax_tpu.launch import job

    run_dir = work / f"{mode}_s{base.seed}"
    config = run_config(base, mode, run_dir)
    digest = config.digest()
    result_path = run_dir / "curve_result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("config_digest") == digest:
            if "kl_to_reference" not in result:  # a result from before the KL was measured
                result.update(final_kl(run_dir, warm))
                result_path.write_text(json.dumps(result, indent=2))
            return {**result, "reused": True}
    start_from_warm_start(run_dir, warm)
    t0 = time.perf_counter()
    with open(work / f"{mode}_s{base.seed}.log", "w") as out, contextlib.redirect_stdout(out):
        job.run(config)
    size = config.controller.eval_size
    curve = read_curve(run_dir)
    result = {
        "mode": mode,
        "seed": base.seed,
        "reload_every": config.staleness.reload_every,
        "max_staleness": config.staleness.max_staleness,
        "config_digest": digest,
        "eval_size": size,
        **curve,
        "interval95": [wilson_interval(a, size) for a in curve["accuracy"]],
        **final_kl(run_dir, warm),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    result_path.write_text(json.dumps(result, indent=2))
    return {**result, "reused": False}


# -- the criteria and the report -----------------------------------------------------------------
def criteria(
    steps: Sequence[int], accuracy: Sequence[float], num_steps: int, every: int = 0
) -> dict[str, Any]:
    """gain = final − first evaluation; late_drop = the largest fall of an evaluation after
    the first quarter of the run below the evaluation before it (0 if none fell). With
    `every` > 0 only the evaluations at multiples of `every` and the last one count: a run
    evaluated every 10 steps judged as if it had been evaluated every 20."""
    if every > 0:
        kept = [i for i, s in enumerate(steps) if s % every == 0 or i == len(steps) - 1]
        steps, accuracy = [steps[i] for i in kept], [accuracy[i] for i in kept]
    drops = [
        accuracy[i - 1] - accuracy[i] for i in range(1, len(steps)) if steps[i] > num_steps / 4
    ]
    return {
        "start": accuracy[0],
        "final": accuracy[-1],
        "gain": accuracy[-1] - accuracy[0],
        "late_drop": max([0.0, *drops]),
    }


def passes(c: dict[str, Any], min_gain: float, max_drop: float) -> bool:
    return c["gain"] >= min_gain - 1e-9 and c["late_drop"] <= max_drop + 1e-9


def diagnostics_by_quarter(result: dict, num_steps: int) -> dict[str, list[float]]:
    """Per diagnostic: its mean over each quarter of the run's steps."""
    out = {}
    for name, series in result["diagnostics"].items():
        quarters: list[list[float]] = [[], [], [], []]
        for step, value in zip(series["steps"], series["values"], strict=True):
            quarters[min(3, (step - 1) * 4 // max(num_steps, 1))].append(value)
        out[name] = [statistics.mean(q) if q else math.nan for q in quarters]
    return out


DIAGNOSTIC_COLUMNS = {
    "reward_mean": "reward",
    "train/entropy": "entropy",
    "train/zero_variance_group_fraction": "zero-variance groups",
    "train/clip_fraction": "clip fraction",
    "train/kl": "k3 KL to SFT",
}


def diagnostics_table(results: list[dict], num_steps: int) -> str:
    """Per mode, the mean over seeds of each diagnostic in the first and the last quarter of
    the run ("first → last")."""
    names = [n for n in DIAGNOSTIC_COLUMNS if all(n in r["diagnostics"] for r in results)]
    lines = [
        "| mode | " + " | ".join(DIAGNOSTIC_COLUMNS[n] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for mode in dict.fromkeys(r["mode"] for r in results):
        runs = [diagnostics_by_quarter(r, num_steps) for r in results if r["mode"] == mode]
        cells = []
        for n in names:
            first = statistics.mean(q[n][0] for q in runs)
            last = statistics.mean(q[n][3] for q in runs)
            cells.append(f"{first:.3g} → {last:.3g}")
        lines.append(f"| {LABELS[mode]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curves(results: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per mode: the mean, min and max over seeds of the accuracy at each evaluation step
    (steps every seed evaluated)."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        runs = [r for r in results if r["mode"] == mode]
        steps = sorted(set.intersection(*(set(r["eval_steps"]) for r in runs)))
        at = [[r["accuracy"][r["eval_steps"].index(s)] for r in runs] for s in steps]
        out[mode] = {
            "steps": steps,
            "seeds": [r["seed"] for r in runs],
            "mean": [statistics.mean(v) for v in at],
            "min": [min(v) for v in at],
            "max": [max(v) for v in at],
        }
    return out


def markdown_table(
    results: list[dict], num_steps: int, min_gain: float, max_drop: float, every: int = 0
) -> str:
    """One row per run: SFT start, final, gain, largest late drop, the final policy's KL to
    the SFT model (nats per response), and whether both criteria hold."""
    lines = [
        "| mode | seed | SFT start | final | gain | largest late drop | KL to SFT | criteria |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (list(MODES).index(r["mode"]), r["seed"])):
        c = criteria(r["eval_steps"], r["accuracy"], num_steps, every)
        kl = f"{r['kl_to_reference']:.3f}" if "kl_to_reference" in r else "–"
        lines.append(
            f"| {LABELS[r['mode']]} | {r['seed']} | {c['start']:.3f} | {c['final']:.3f} | "
            f"{c['gain']:+.3f} | {c['late_drop']:.3f} | {kl} | "
            f"{'met' if passes(c, min_gain, max_drop) else 'MISSED'} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], size: int, num_steps: int, path: Path) -> None:
    """One panel per mode: each seed's curve, and the mean with the min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_mode = curves(results)
    fig, axes = plt.subplots(1, len(by_mode), figsize=(4.5 * len(by_mode), 3.8), squeeze=False)
    for ax, (mode, c) in zip(axes[0], by_mode.items(), strict=True):
        for r in (r for r in results if r["mode"] == mode):
            ax.plot(r["eval_steps"], r["accuracy"], lw=0.8, alpha=0.5, label=f"seed {r['seed']}")
        ax.fill_between(c["steps"], c["min"], c["max"], alpha=0.2, label="min–max")
        ax.plot(c["steps"], c["mean"], lw=2, color="black", label="mean")
        ax.set_title(LABELS[mode])
        ax.set_xlabel("RL step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"held-out greedy accuracy ({size} prompts)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    seeds = len({r["seed"] for r in results})
    fig.suptitle(f"Learning curves of the demo ({num_steps} RL steps, {seeds} seed(s))")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny_cpu.py"))
    parser.add_argument("--quick", action="store_true", help="2 seeds x 2 modes, a few steps")
    parser.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; quick 0,1)")
    parser.add_argument("--modes", help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--work-dir", type=Path, help="default runs/learning_curves[_quick]")
    parser.add_argument("--min-gain", type=float, default=MIN_GAIN)
    parser.add_argument("--max-drop", type=float, default=MAX_DROP)
    parser.add_argument("--no-check", action="store_true", help="exit 0 whatever the criteria")
    parser.add_argument(
        "--criteria-every",
        type=int,
        default=0,
        help="judge only the evaluations at multiples of this step (and the last)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override key=value"
    )
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(",")) if args.modes else (QUICK_MODES if args.quick else MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    seeds = (
        tuple(int(s) for s in args.seeds.split(","))
        if args.seeds
        else (QUICK_SEEDS if args.quick else SEEDS)
    )
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    base = load_config(args.config, overrides)
    configure_jax(base)  # before JAX starts: the SFT trainer's mesh needs cpu_devices
    ctl = base.controller
    if ctl.eval_every <= 0:
        parser.error("controller.eval_every is 0: a curve needs evaluations during the run")
    work = args.work_dir or ROOT / "runs" / (
        "learning_curves_quick" if args.quick else "learning_curves"
    )
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for seed in seeds:
        seeded = dataclasses.replace(base, seed=seed)
        steps = base.trainer.warm_start.steps
        print(f"work dir {work}; seed {seed}: SFT warm start ({steps} steps)", flush=True)
        warm = warm_start(seeded, work)
        for mode in modes:
            r = run_one(seeded, mode, warm, work)
            results.append(r)
            c = criteria(r["eval_steps"], r["accuracy"], ctl.num_steps, args.criteria_every)
            print(
                f"{LABELS[mode]:<11} seed {seed}: "
                + " ".join(f"{a:.3f}" for a in r["accuracy"])
                + f"  gain {c['gain']:+.3f}  late drop {c['late_drop']:.3f}  "
                + f"KL {r['kl_to_reference']:.3f}  "
                + ("(reused)" if r["reused"] else f"{r['wall_s']:.0f}s"),
                flush=True,
            )
    table = markdown_table(
        results, ctl.num_steps, args.min_gain, args.max_drop, args.criteria_every
    )
    judged = [
        criteria(r["eval_steps"], r["accuracy"], ctl.num_steps, args.criteria_every)
        for r in results
    ]
    verdicts = [passes(c, args.min_gain, args.max_drop) for c in judged]
    half = max(h - lo for r in results for lo, h in r["interval95"]) / 2
    print()
    print(
        f"{Path(args.config).name}: {ctl.num_steps} RL steps of {ctl.prompts_per_batch}x"
        f"{ctl.samples_per_prompt}, held-out greedy accuracy on {ctl.eval_size} prompts every "
        f"{ctl.eval_every} steps (95 % interval of one evaluation: ± {half:.3f} at most); "
        f"criteria: gain >= {args.min_gain:.2f}, no evaluation after step {ctl.num_steps / 4:g} "
        f"more than {args.max_drop:.2f} below the previous one"
        + (f" (evaluations every {args.criteria_every} steps)" if args.criteria_every else "")
    )
    print(table)
    diagnostics = diagnostics_table(results, ctl.num_steps)
    print()
    print("trainer diagnostics, mean over seeds, first quarter of the run → last quarter:")
    print(diagnostics)
    wall = time.perf_counter() - t0
    print(f"{sum(verdicts)}/{len(verdicts)} runs met both criteria; total {wall:.0f}s")
    report = {
        "config": str(args.config),
        "quick": args.quick,
        "overrides": overrides,
        "modes": {m: dataclasses.asdict(MODES[m]) for m in modes},
        "seeds": list(seeds),
        "num_steps": ctl.num_steps,
        "eval_every": ctl.eval_every,
        "eval_size": ctl.eval_size,
        "min_gain": args.min_gain,
        "max_drop": args.max_drop,
        "criteria_every": args.criteria_every,
        "runs": [
            {
                **r,
                "criteria": c,
                "met": v,
                "diagnostics_by_quarter": diagnostics_by_quarter(r, ctl.num_steps),
            }
            for r, c, v in zip(results, judged, verdicts, strict=True)
        ],
        "curves": curves(results),
        "table_markdown": table,
        "diagnostics_markdown": diagnostics,
        "wall_s": round(wall, 1),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(results, ctl.eval_size, ctl.num_steps, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(verdicts) or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
