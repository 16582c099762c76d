#!/usr/bin/env python3
"""Does a config learn, in every seed and staleness mode? Held-out accuracy curves with spread.

    python tools/learning_curves.py [CONFIG] [--compare OTHER ...] [--quick] [--seeds 0,1,2]
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

`--compare OTHER.py [...]` runs other configs the same way (each its own warm start, the
same seeds and modes) and compares them with the first: per mode, the first config's final
accuracy minus each other's, per seed, with the mean's 95 % t-interval over seeds; the
comparison holds when that interval is above zero. The criteria above then judge the first
config's runs only. configs/tiny_cpu_tools.py --compare configs/tiny_cpu_no_tools.py is the
tool-use demo's claim (docs/agents.md): RL with a calculator beats the same model without.
Runs with an environment (controller.environment) also report their tool use per step (the
share of episodes that called a tool, the share of calls that failed); their KL to the SFT
model is not measured (the measurement samples single-turn responses).

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
    "episode/tool_call_rate",
    "episode/tool_error_rate",
    "episode/turns",
)
# Two-sided 95 % quantiles of Student's t by degrees of freedom (the comparison's interval).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
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


def run_one(base: RunConfig, mode: str, warm: Path, work: Path, arm: str = "") -> dict[str, Any]:
    """The whole job for `mode` from the warm start, and its curve (reused from a finished
    run of the same config). `arm` names the config among compared ones ("" alone)."""
    from rlax_tpu.launch import job

    name = f"{arm}_{mode}_s{base.seed}" if arm else f"{mode}_s{base.seed}"
    run_dir = work / name
    config = run_config(base, mode, run_dir)
    digest = config.digest()
    episodes = config.controller.environment.enabled
    result_path = run_dir / "curve_result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("config_digest") == digest:
            if "kl_to_reference" not in result and not episodes:  # from before the KL
                result.update(final_kl(run_dir, warm))
                result_path.write_text(json.dumps(result, indent=2))
            return {**result, "reused": True}
    start_from_warm_start(run_dir, warm)
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as out, contextlib.redirect_stdout(out):
        job.run(config)
    size = config.controller.eval_size
    curve = read_curve(run_dir)
    result = {
        "arm": arm,
        "mode": mode,
        "seed": base.seed,
        "reload_every": config.staleness.reload_every,
        "max_staleness": config.staleness.max_staleness,
        "config_digest": digest,
        "eval_size": size,
        **curve,
        "interval95": [wilson_interval(a, size) for a in curve["accuracy"]],
        **({} if episodes else final_kl(run_dir, warm)),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    result_path.write_text(json.dumps(result, indent=2))
    return {**result, "reused": False}


def report_run(r: dict[str, Any], num_steps: int, every: int) -> None:
    c = criteria(r["eval_steps"], r["accuracy"], num_steps, every)
    kl = f"KL {r['kl_to_reference']:.3f}  " if "kl_to_reference" in r else ""
    print(
        f"{label_of(group_of(r)):<11} seed {r['seed']}: "
        + " ".join(f"{a:.3f}" for a in r["accuracy"])
        + f"  gain {c['gain']:+.3f}  late drop {c['late_drop']:.3f}  {kl}"
        + ("(reused)" if r["reused"] else f"{r['wall_s']:.0f}s"),
        flush=True,
    )


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


def group_of(r: dict) -> tuple[str, str]:
    return (r.get("arm", ""), r["mode"])


def key_of(group: tuple[str, str]) -> str:
    """A group's key in the report's curves: the mode, after the config's name if compared."""
    arm, mode = group
    return f"{arm}/{mode}" if arm else mode


def label_of(group: tuple[str, str]) -> str:
    arm, mode = group
    return f"{arm} {LABELS[mode]}" if arm else LABELS[mode]


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95 % Student-t interval (±inf for one value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, -math.inf, math.inf
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def comparison(results: list[dict], arms: Sequence[str]) -> list[dict[str, Any]]:
    """Per mode and other arm: the first arm's final accuracy minus the other's, per seed
    (paired: the same seed's prompt order), with the mean's 95 % t-interval over seeds."""
    out = []
    final = {(r.get("arm", ""), r["mode"], r["seed"]): r["accuracy"][-1] for r in results}
    for mode in dict.fromkeys(r["mode"] for r in results):
        for other in arms[1:]:
            seeds = sorted(
                s for (a, m, s) in final if a == arms[0] and m == mode and (other, m, s) in final
            )
            diffs = [final[(arms[0], mode, s)] - final[(other, mode, s)] for s in seeds]
            if not diffs:
                continue
            mean, low, high = t_interval(diffs)
            out.append(
                {
                    "mode": mode,
                    "arm": arms[0],
                    "other": other,
                    "seeds": seeds,
                    "differences": diffs,
                    "mean": mean,
                    "interval95": [low, high],
                    "holds": low > 0,
                }
            )
    return out


def comparison_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | compared | final accuracy difference per seed | mean [95 % t-interval] | holds |",
        "|---|---|---|---|---|",
    ]
    for c in rows:
        low, high = c["interval95"]
        lines.append(
            f"| {LABELS[c['mode']]} | {c['arm']} − {c['other']} | "
            + ", ".join(f"{d:+.3f}" for d in c["differences"])
            + f" | {c['mean']:+.3f} [{low:+.3f}, {high:+.3f}] | {'yes' if c['holds'] else 'NO'} |"
        )
    return "\n".join(lines)


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
    "episode/tool_call_rate": "tool-call rate",
    "episode/tool_error_rate": "tool errors",
}


def diagnostics_table(results: list[dict], num_steps: int) -> str:
    """Per mode (and compared config), the mean over seeds of each diagnostic in the first
    and the last quarter of the run ("first → last"; "–" where those runs do not log it)."""
    names = [n for n in DIAGNOSTIC_COLUMNS if any(n in r["diagnostics"] for r in results)]
    lines = [
        "| run | " + " | ".join(DIAGNOSTIC_COLUMNS[n] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for group in dict.fromkeys(group_of(r) for r in results):
        chosen = [r for r in results if group_of(r) == group]
        runs = [diagnostics_by_quarter(r, num_steps) for r in chosen]
        cells = []
        for n in names:
            if not all(n in r["diagnostics"] for r in chosen):
                cells.append("–")
                continue
            first = statistics.mean(q[n][0] for q in runs)
            last = statistics.mean(q[n][3] for q in runs)
            cells.append(f"{first:.3g} → {last:.3g}")
        lines.append(f"| {label_of(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curves(results: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per mode (and compared config): the mean, min and max over seeds of the accuracy at
    each evaluation step (steps every seed evaluated)."""
    out = {}
    for group in dict.fromkeys(group_of(r) for r in results):
        runs = [r for r in results if group_of(r) == group]
        steps = sorted(set.intersection(*(set(r["eval_steps"]) for r in runs)))
        at = [[r["accuracy"][r["eval_steps"].index(s)] for r in runs] for s in steps]
        out[key_of(group)] = {
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
        "| run | seed | SFT start | final [95 % interval] | gain | largest late drop | "
        "KL to SFT | criteria |",
        "|---|---|---|---|---|---|---|---|",
    ]
    arms = list(dict.fromkeys(r.get("arm", "") for r in results))
    for r in sorted(
        results,
        key=lambda r: (arms.index(r.get("arm", "")), list(MODES).index(r["mode"]), r["seed"]),
    ):
        c = criteria(r["eval_steps"], r["accuracy"], num_steps, every)
        kl = f"{r['kl_to_reference']:.3f}" if "kl_to_reference" in r else "–"
        low, high = r["interval95"][-1]
        judged = r.get("arm", "") == arms[0]  # compared configs are not held to the criteria
        verdict = ("met" if passes(c, min_gain, max_drop) else "MISSED") if judged else "–"
        lines.append(
            f"| {label_of(group_of(r))} | {r['seed']} | {c['start']:.3f} | "
            f"{c['final']:.3f} [{low:.3f}–{high:.3f}] | {c['gain']:+.3f} | "
            f"{c['late_drop']:.3f} | {kl} | {verdict} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], size: int, num_steps: int, path: Path) -> None:
    """One panel per mode: each seed's curve, and the mean with the min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_group = curves(results)
    fig, axes = plt.subplots(1, len(by_group), figsize=(4.5 * len(by_group), 3.8), squeeze=False)
    for ax, (key, c) in zip(axes[0], by_group.items(), strict=True):
        for r in (r for r in results if key_of(group_of(r)) == key):
            ax.plot(r["eval_steps"], r["accuracy"], lw=0.8, alpha=0.5, label=f"seed {r['seed']}")
        ax.fill_between(c["steps"], c["min"], c["max"], alpha=0.2, label="min–max")
        ax.plot(c["steps"], c["mean"], lw=2, color="black", label="mean")
        ax.set_title(label_of(group_of(next(r for r in results if key_of(group_of(r)) == key))))
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
    parser.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="CONFIG",
        help="other configs run the same way and compared with the first",
    )
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
    paths = [args.config, *args.compare]
    bases = [load_config(path, overrides) for path in paths]
    base = bases[0]
    arms = [Path(path).stem for path in paths] if args.compare else [""]
    if len(set(arms)) != len(arms):
        parser.error(f"the compared configs need distinct file names, got {paths}")
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
        for arm, arm_base in zip(arms, bases, strict=True):
            seeded = dataclasses.replace(arm_base, seed=seed)
            steps = arm_base.trainer.warm_start.steps
            print(
                f"work dir {work}; {arm or 'seed'} {seed}: SFT warm start ({steps} steps)",
                flush=True,
            )
            warm = warm_start(seeded, work)
            for mode in modes:
                r = run_one(seeded, mode, warm, work, arm)
                results.append(r)
                report_run(r, ctl.num_steps, args.criteria_every)
    table = markdown_table(
        results, ctl.num_steps, args.min_gain, args.max_drop, args.criteria_every
    )
    judged = [
        criteria(r["eval_steps"], r["accuracy"], ctl.num_steps, args.criteria_every)
        for r in results
    ]
    verdicts = [
        passes(c, args.min_gain, args.max_drop) if r.get("arm", "") == arms[0] else True
        for r, c in zip(results, judged, strict=True)
    ]
    compared = comparison(results, arms) if args.compare else []
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
    if compared:
        print()
        print("final held-out accuracy, paired by seed:")
        print(comparison_table(compared))
    own = [v for r, v in zip(results, verdicts, strict=True) if r.get("arm", "") == arms[0]]
    print(f"{sum(own)}/{len(own)} runs met both criteria; total {wall:.0f}s")
    report = {
        "config": str(args.config),
        "compare": list(args.compare),
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
        "comparison": compared,
        "table_markdown": table,
        "diagnostics_markdown": diagnostics,
        "wall_s": round(wall, 1),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(results, ctl.eval_size, ctl.num_steps, args.plot)
        print(f"plot: {args.plot}")
    held = all(verdicts) and all(c["holds"] for c in compared)
    return 0 if held or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
