"""What `rlax-tpu simulate` prints and writes: a table of the simulated run, its JSON, the
comparison of in-flight weight updates with "off" when the config turns them on, and a PNG
(timeline of the trainer and workers, staleness histogram) when matplotlib is installed
(`pip install rlax_tpu[plots]`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlax_tpu.simulator.events import SimResult
from rlax_tpu.simulator.model import TimingModel, Workload


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed: the PNG cannot be drawn (everything else works)."""


def describe(workload: Workload, timing: TimingModel) -> dict[str, Any]:
    p, plan = workload.policy, workload.in_flight
    return {
        "num_steps": workload.num_steps,
        "batch": f"{workload.prompts_per_batch} prompts x {workload.samples_per_prompt}",
        "num_workers": workload.num_workers,
        "reload_every": p.reload_every,
        "max_staleness": p.max_staleness,
        "schedule": p.schedule,
        "in_flight_update": plan.mode if plan else "off",
        "tick_tokens": plan.tick_tokens if plan else 0,
        "ticks_carried": plan.segments if plan else 0,  # J = N - η
        "share_prompt_pages": workload.share_prompt_pages,
        "tokens_per_row": workload.tokens_per_row,  # 0: padded train rows
        "model_bytes": workload.model_bytes,
        "response_tokens_mean": workload.response_tokens.mean(),
        "timing": timing.to_dict(),
    }


def report(
    workload: Workload,
    timing: TimingModel,
    result: SimResult,
    *,
    target_steps: int | None = None,
    notes: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """The JSON form of a simulated run."""
    out = {"run": describe(workload, timing), "notes": list(notes), **result.summary()}
    target = target_steps or workload.num_steps
    out["target_steps"] = target
    out["time_to_target_steps_s"] = result.time_to_step(target)
    return out


# What the in-flight comparison sets side by side, with its label.
_COMPARED = (
    ("steps_per_s", "steps/s (warm)"),
    ("generation_tokens_per_s", "generation tokens/s"),
    ("worker_idle_fraction", "inference workers idle"),
)


def in_flight_comparison(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """The configured in-flight mode (`on`, a report) against "off" (`off`, the report of
    the same workload and timings without it): each figure of both and their ratio, on /
    off. `speedup` is that of steps/s."""
    mode = on["run"]["in_flight_update"]
    out: dict[str, Any] = {"mode": mode}
    for key, _ in _COMPARED:
        ratio = on[key] / off[key] if off[key] else math.inf
        out[key] = {"off": off[key], mode: on[key], "ratio": ratio}
    out["speedup"] = out["steps_per_s"]["ratio"]
    return out


def format_in_flight(comparison: dict[str, Any]) -> str:
    mode = comparison["mode"]
    width = max(len(label) for _, label in _COMPARED)
    lines = [
        f"in-flight updates ({mode}) against off, same workload and timings:",
        f"  {'':<{width}}  {'off':>10}  {mode:>10}  {'ratio':>7}",
    ]
    for key, label in _COMPARED:
        row = comparison[key]
        fmt = "{:>10.1%}" if key.endswith("fraction") else "{:>10.4g}"
        values = fmt.format(row["off"]) + "  " + fmt.format(row[mode])
        lines.append(f"  {label:<{width}}  {values}  {row['ratio']:>6.2f}x")
    return "\n".join(lines)


def _fmt_s(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def format_table(figures: dict[str, Any]) -> str:
    run = figures["run"]
    lines = [
        f"simulated run: {run['num_steps']} steps of {run['batch']}, {run['num_workers']} "
        f"inference worker(s), η={run['reload_every']} N={run['max_staleness']} "
        f"({run['schedule']}), {run['model_bytes'] / 2**30:.2f} GiB per version, "
        f"mean response {run['response_tokens_mean']:.0f} tokens",
    ]
    if run["tokens_per_row"]:
        lines[0] += f", train rows packed into {run['tokens_per_row']} tokens"
    if run["in_flight_update"] != "off":
        lines[0] += (
            f", in-flight updates {run['in_flight_update']} (a response carried into up to "
            f"{run['ticks_carried']} more ticks, {run['tick_tokens']} tokens a tick)"
        )
    lines += [f"  calibration: {note}" for note in figures["notes"]]
    hist = figures["staleness_histogram"]
    shown = ", ".join(f"{k}: {v}" for k, v in list(hist.items())[:12])
    rows = [
        ("step time (mean, all in)", _fmt_s(figures["step_time_s"])),
        ("step time (warm, evals out)", _fmt_s(figures["warm_step_time_s"])),
        ("trainer idle", f"{figures['trainer_idle_fraction']:.1%}"),
        ("inference workers idle", f"{figures['worker_idle_fraction']:.1%}"),
        ("generation tokens/s", f"{figures['generation_tokens_per_s']:.4g}"),
        (
            "staleness of consumed rollouts",
            f"mean {figures['staleness_mean']:.2f}, max {figures['staleness_max']}",
        ),
        ("staleness histogram", shown + (", ..." if len(hist) > 12 else "")),
        (
            "rollouts generated / consumed",
            f"{figures['rollouts_generated']} / {figures['rollouts_consumed']}",
        ),
        ("rollouts discarded", str(figures["rollouts_discarded"])),
        ("continuations after a pause", str(figures["continuations"])),
        ("weight reloads", str(figures["reloads"])),
        ("preemptions (time lost)", f"{figures['preemptions']} ({_fmt_s(figures['lost_s'])})"),
        (f"time to {figures['target_steps']} steps", _fmt_s(figures["time_to_target_steps_s"])),
        ("wall time", _fmt_s(figures["wall_s"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def format_analytical(sync: Any, asyn: Any, disaggregated_s: float) -> str:
    return "\n".join(
        [
            "LlamaRL step-time model (paper §7):",
            f"  synchronous co-located   step {_fmt_s(sync.step_s)}  (m={sync.m_train:.3g}, "
            f"b_t={sync.b_train}, b_g={sync.b_gen})",
            f"  asynchronous (optimum)   step {_fmt_s(asyn.step_s)}  (θ**={asyn.theta:.3f}, "
            f"m_t={asyn.m_train:.3g}, m_g={asyn.m_gen:.3g}, b_t={asyn.b_train}, "
            f"b_g={asyn.b_gen})",
            f"  disaggregated synchronous step {_fmt_s(disaggregated_s)}",
            f"  speedup async vs sync    {sync.step_s / asyn.step_s:.2f}x",
        ]
    )


def plot(result: SimResult, path: str | Path, title: str = "") -> None:
    """Timeline (trainer, workers, controller) and the staleness histogram, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailableError(
            "the PNG needs matplotlib: pip install 'rlax_tpu[plots]' (the table and JSON do not)"
        ) from e
    lanes = sorted({who for who, _, _, _ in result.timeline}, key=_lane_order)
    fig, (ax_time, ax_hist) = plt.subplots(
        1, 2, figsize=(13, 1.2 + 0.45 * max(3, len(lanes))), width_ratios=(3, 1)
    )
    colors = {
        "gen": "tab:blue",
        "eval": "tab:purple",
        "load": "tab:orange",
        "train": "tab:green",
        "verify+assemble": "tab:gray",
    }
    for who, what, start, end in result.timeline:
        kind = what.split(" ")[0]
        ax_time.broken_barh(
            [(start, max(end - start, 1e-9))],
            (lanes.index(who) - 0.4, 0.8),
            color=colors.get(kind, "tab:red"),
        )
    for t in result.preemptions:
        ax_time.axvline(t, color="red", linestyle="--", linewidth=1)
    ax_time.set_yticks(range(len(lanes)), lanes)
    ax_time.set_xlabel("seconds")
    ax_time.set_title(title or "simulated timeline (blue gen, orange load, green train)")
    hist = result.staleness_histogram()
    ax_hist.bar(list(hist), list(hist.values()), color="tab:blue")
    ax_hist.set_xlabel("staleness (batch − version)")
    ax_hist.set_ylabel("rollouts trained on")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lane_order(who: str) -> tuple[int, int]:
    if who == "trainer":
        return (0, 0)
    if who == "controller":
        return (1, 0)
    return (2, int(who.split(" ")[1]) if " " in who else 0)
