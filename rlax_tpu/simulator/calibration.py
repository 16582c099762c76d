"""Calibration of the simulator: figures read from benchmark JSON (tools/bench_*.py), from
`rlax-tpu compile` reports (simulator/compiled.py), from hardware figures and from explicit
settings, applied in that order by `calibrate` onto the TimingModel of simulator/model.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu.config import ConfigError, RunConfig
from rlax_tpu.simulator import workloads as bench_workload
from rlax_tpu.simulator.compiled import from_compile_report
from rlax_tpu.simulator.model import (
    CalibrationError,
    HardwareSpec,
    SimulatorConfig,
    TimingModel,
    Workload,
    count_params,
    decode_flops_per_token,
    train_flops_per_token,
)


def _read(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise CalibrationError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml), or give it as JSON"
            ) from e
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: expected a mapping at the top level")
    return data


def benchmark_kind(data: Mapping[str, Any]) -> str:
    """Which tools/bench_*.py wrote `data`, or "compile" for an `rlax-tpu compile --json`
    report ("" when none: then it is a settings file)."""
    if "train_step_roofline_s" in data and "programs" in data and "config_digest" in data:
        return "compile"
    if "speedup_off_vs_on" in data and "on_policy" in data:
        return "e2e"
    if "slot_utilization" in data and "tokens_per_s" in data:
        return "inference"
    if "configs" in data and "step_s" in data and "mfu" in data:
        return "trainer"
    if "publish_bytes_per_s" in data and "pull_bytes_per_s" in data:
        return "param_server"
    if "verifications_per_s" in data and "p50_s" in data:
        return "verifier"
    return ""


@dataclasses.dataclass
class Calibration:
    """Figures gathered from calibration files, applied by `calibrate` in a fixed order:
    benchmarks, then hardware figures, then compile reports (in the order given), then
    explicit settings (files in the order given, then --set)."""

    benchmarks: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    compile_reports: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    settings: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)

    def add_file(self, path: str | Path) -> None:
        data = _read(path)
        kind = benchmark_kind(data)
        if kind == "compile":  # (path, report): its notes name the file
            self.compile_reports.append((str(path), data))
            self.sources.append(f"{path} (rlax-tpu compile report)")
        elif kind:
            self.benchmarks.setdefault(kind, []).append(data)
            self.sources.append(f"{path} ({kind} benchmark)")
        else:
            self.add_settings(data)
            self.sources.append(f"{path} (settings)")

    def add_settings(self, data: Mapping[str, Any], prefix: str = "") -> None:
        """Nested settings of SimulatorConfig, e.g. {"timing": {"restart_s": 600}}; a
        distribution or the hardware may be given whole."""
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            whole = dotted in ("response_tokens", "prompt_tokens") or dotted.endswith("_tokens")
            if isinstance(value, Mapping) and not whole:
                self.add_settings(value, dotted + ".")
            else:
                self.settings.append((dotted, value))

    def add_overrides(self, overrides: Iterable[str]) -> None:
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            self.settings.append((key.strip(), value.strip()))


def calibrate(
    config: RunConfig, calibration: Calibration | None = None
) -> tuple[Workload, TimingModel, SimulatorConfig, list[str]]:
    """The workload and timing model of `config` under `calibration`, the simulator settings,
    and notes saying where each figure came from (and what was assumed)."""
    calibration = calibration or Calibration()
    sim = _settings(calibration.settings)
    workload = Workload.from_config(config, sim)
    notes: list[str] = []
    figures: dict[str, float] = {}
    bench = calibration.benchmarks
    for kind, fit in (
        ("trainer", _from_trainer_bench),
        ("inference", _from_inference_bench),
        ("param_server", _from_param_server_bench),
        ("verifier", _from_verifier_bench),
    ):
        if kind in bench:
            found, note = fit(workload, bench[kind])
            figures.update(found)
            notes.append(note)
    loads = [r for run in bench.get("inference", []) for r in run.get("worker_load", {}).values()]
    if loads:  # a worker's whole load, measured: its pull is what is left of it
        found, note = _pull_from_worker_loads(loads, figures, sim.timing)
        figures.update(found)
        notes.append(note)
    services = [run["service"] for run in bench.get("trainer", []) if "service" in run]
    if services:  # the trainer's own publish, measured: the per-version cost is what is left
        svc, t = services[-1], dataclasses.replace(sim.timing, **figures)
        rest = svc["publish_s"] - svc["arrays"] * t.publish_s_per_array
        figures["publish_fixed_s"] = max(0.0, rest - svc["bytes"] / t.publish_bytes_per_s)
        notes.append(
            f"trainer publish: {svc['publish_s'] * 1e3:.1f} ms measured for {svc['arrays']} "
            f"arrays -> {figures['publish_fixed_s'] * 1e3:.1f} ms per version"
        )
    if sim.hardware.given:
        found, note = _from_hardware(workload, sim.hardware)
        figures.update(found)
        notes.append(note)
    if calibration.compile_reports:
        # The compiled programs' rooflines on the config's own topologies: more specific
        # than the hardware figures' analytical roofline, so they come after them.
        for path, data in calibration.compile_reports:
            found, found_notes = from_compile_report(config, workload, data, sim.hardware, path)
            replaced = sorted(k for k in found if k in figures)
            if replaced:
                found_notes[0] += f"; replaces the earlier sources' {', '.join(replaced)}"
            figures.update(found)
            notes.extend(found_notes)
    explicit = {k.split(".", 1)[1] for k, _ in calibration.settings if k.startswith("timing.")}
    figures = {k: v for k, v in figures.items() if k not in explicit}
    if explicit:
        notes.append(f"set explicitly: {', '.join(sorted(explicit))}")
    timing = dataclasses.replace(sim.timing, **figures)
    if not bench and not calibration.compile_reports and not sim.hardware.given and not explicit:
        notes.append("no calibration given: TimingModel defaults (CPU demo-scale guesses)")
    sim = dataclasses.replace(sim, timing=timing)
    return Workload.from_config(config, sim), timing, sim, notes


def _settings(settings: Sequence[tuple[str, Any]]) -> SimulatorConfig:
    """SimulatorConfig with file settings merged first (validated together, so related
    values may come in any order), then command-line ones (text, parsed by field type)."""
    merged = SimulatorConfig().to_dict()
    for key, value in settings:
        if isinstance(value, str):
            continue
        *parents, leaf = key.split(".")
        node = merged
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    try:
        sim = SimulatorConfig.from_dict(merged)
    except ConfigError as e:
        raise ConfigError(f"calibration settings: {e}") from None
    for key, value in settings:
        if isinstance(value, str):
            try:
                sim = sim.override(key, value)
            except ConfigError as e:
                raise ConfigError(f"setting {key}={value}: {e}") from None
    return sim


def _fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares y = a + b·x with a, b >= 0 (b only, through 0, from one point)."""
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        x = sum(p[0] for p in points)
        return 0.0, sum(p[1] for p in points) / x if x else 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    if a < 0:  # no negative fixed cost: refit through the origin
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    if b < 0:
        return my, 0.0
    return a, b


def _from_trainer_bench(workload: Workload, runs: list[dict]) -> tuple[dict, str]:
    """step_s = fixed + FLOPs × seconds-per-FLOP over every benchmarked model (6·N·tokens,
    the trainer's own MFU count), then the run's model at its FLOPs per token."""
    points = []
    for run in runs:
        for entry in run.get("configs", {}).values():
            points.append((6.0 * entry["params"] * entry["tokens_per_step"], entry["step_s"]))
        if "service" in run:  # the RL-shaped step timed end to end: one more point
            svc = run["service"]
            points.append((6.0 * svc["params"] * svc["rows"] * svc["seq"], svc["step_s"]))
    if not points:
        raise CalibrationError("trainer benchmark JSON without per-config figures ('configs')")
    fixed, s_per_flop = _fit_line(points)
    per_token = s_per_flop * 6.0 * count_params(workload.model)
    figures = {"train_fixed_s": fixed, "train_s_per_token": per_token}
    note = (
        f"trainer: {len(points)} benchmarked step(s) -> fixed {fixed * 1e3:.1f} ms + "
        f"{1 / s_per_flop / 1e9 if s_per_flop else float('inf'):.2f} GFLOP/s"
    )
    services = [run["service"] for run in runs if "service" in run]
    if services:
        svc = services[-1]
        # The compile of a new padded length, as measured (it does not scale by FLOPs: give
        # it explicitly for another model or compiler); the first step's compile alike.
        figures["trainer_compile_s"] = (svc["compile_s"] + svc["recompile_s"]) / 2
        figures["train_overhead_s"] = svc["overhead_s"]
        figures["checkpoint_s"] = svc["checkpoint_s"]
        note += (
            f"; train_step end to end: +{svc['overhead_s'] * 1e3:.1f} ms around the step, "
            f"+{svc['checkpoint_s'] * 1e3:.0f} ms per checkpoint, compile of a new length "
            f"{figures['trainer_compile_s']:.2f} s"
        )
    return figures, note


def _from_inference_bench(workload: Workload, runs: list[dict]) -> tuple[dict, str]:
    """Engine wall time = calls × seconds-per-call + FLOPs × seconds-per-FLOP, fitted over
    the benchmark runs (runs at different --decode-steps separate the two; from one run the
    per-call cost is taken as 0). Decode FLOPs count every row the engine computed (live
    slots padded to a decode bucket: useful tokens / slot_utilization); prefill FLOPs the
    whole bucket; FLOPs per token from the benchmark."""
    rows = _rl_batch_rows(runs)
    for run in runs if not rows else ():
        total_s = run["useful_tokens"] / run["tokens_per_s"]
        slots, k = run["decode_slots"], run["decode_steps_per_call"]
        rows_computed = run["useful_tokens"] / run["slot_utilization"]
        prompts, outputs = bench_workload.lengths(run["requests"])
        if sum(outputs) != run["useful_tokens"]:
            raise CalibrationError(
                f"an inference benchmark run of {run['requests']} requests generated "
                f"{run['useful_tokens']} tokens, but the benchmark's workload "
                f"(rlax_tpu.simulator.workloads) has {sum(outputs)}: it was measured with "
                "another workload; measure again with this version's tools/bench_inference.py"
            )
        prefill_tokens = sum(bench_workload.prefill_bucket(p) for p in prompts)
        flops = run["model_flops_per_token"] * (rows_computed + prefill_tokens)
        # Older benchmark files lack the count: every call then ran all slots.
        decode_calls = run.get("decode_calls_per_run", rows_computed / (slots * k))
        calls = run["requests"] + decode_calls
        rows.append((calls, flops, total_s))
    if len({c for c, _, _ in rows}) > 1:
        per_call, s_per_flop = _fit_two(rows)
    else:
        per_call, s_per_flop = 0.0, sum(t for _, _, t in rows) / sum(f for _, f, _ in rows)
    flops_token = decode_flops_per_token(workload.model, workload.mean_context())
    figures = {
        "decode_step_s": workload.decode_slots * flops_token * s_per_flop,
        "decode_call_s": per_call,
        "prefill_call_s": per_call,
        "prefill_s_per_token": flops_token * s_per_flop,
    }
    source = "RL-batch timings" if _rl_batch_rows(runs) else "benchmark run(s)"
    note = (
        f"inference: {len(rows)} {source} -> {per_call * 1e3:.2f} ms per device call + "
        f"{1 / s_per_flop / 1e9:.2f} GFLOP/s; decode step of {workload.decode_slots} slots "
        f"{figures['decode_step_s'] * 1e3:.2f} ms"
    )
    served = [run["served_generate"] for run in runs if "served_generate" in run]
    if served:  # the served worker's Generate less the engine's own time for the same batch
        overheads = [max(0.0, g["overhead_s"]) for g in served]
        figures["job_overhead_s"] = sum(overheads) / len(overheads)
        g = served[-1]
        note += (
            f"; a Generate call costs {figures['job_overhead_s'] * 1e3:.1f} ms beyond the "
            f"engine ({len(served)} run(s): {g['served_ms']:.1f} ms served vs "
            f"{g['in_process_ms']:.1f} ms in-process for {g['requests']} requests)"
        )
    loads = [r for run in runs for r in run.get("worker_load", {}).values()]
    if loads:
        swap = _fit_line([(r["arrays"], r["swap_s"]) for r in loads])
        figures["swap_fixed_s"], figures["swap_s_per_array"] = swap
        note += (
            f"; worker swap {figures['swap_fixed_s'] * 1e3:.1f} ms + "
            f"{figures['swap_s_per_array'] * 1e3:.3f} ms per array"
        )
    return figures, note


def _rl_batch_rows(runs: list[dict]) -> list[tuple[float, float, float]]:
    """(device calls, FLOPs, seconds) of bench_inference's RL-batch timings: one batch of
    short prompts through a rollout worker's engine on its mesh, at 1 and at 8 prefill rows
    (what separates a prefill call's cost from its padded tokens)."""
    rows = []
    for run in runs:
        rl = run.get("rl_batch")
        if not rl or "decode_calls_per_batch" not in rl:
            continue
        k, slots, bucket = rl["decode_steps_per_call"], rl["decode_slots"], rl["prefill_bucket"]
        for name, ms in rl["ms_per_batch"].items():
            prefills, decodes = (
                rl["prefill_calls_per_batch"][name],
                rl["decode_calls_per_batch"][name],
            )
            tokens = prefills * rl["prefill_batch_size"][name] * bucket + decodes * k * slots
            rows.append((prefills + decodes, run["model_flops_per_token"] * tokens, ms / 1e3))
    return rows


def _fit_two(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Non-negative least squares of t = a·calls + b·flops (two unknowns)."""
    s11 = sum(c * c for c, _, _ in rows)
    s12 = sum(c * f for c, f, _ in rows)
    s22 = sum(f * f for _, f, _ in rows)
    y1 = sum(c * t for c, _, t in rows)
    y2 = sum(f * t for _, f, t in rows)
    det = s11 * s22 - s12 * s12
    a = (y1 * s22 - y2 * s12) / det if det else 0.0
    b = (s11 * y2 - s12 * y1) / det if det else 0.0
    if a < 0 or not det:
        return 0.0, y2 / s22
    if b < 0:
        return y1 / s11, 0.0
    return a, b


def _from_param_server_bench(workload: Workload, runs: list[dict]) -> tuple[dict, str]:
    """Publish and pull rates (the largest tree measured; fixed costs fitted when two sizes
    were measured)."""
    sizes = [s for run in runs for s in run.get("sizes", [run])]
    largest = max(sizes, key=lambda s: s["bytes"])
    figures = {
        "publish_bytes_per_s": largest["publish_bytes_per_s"],
        "pull_bytes_per_s": largest["pull_bytes_per_s"],
        "first_pull_bytes_per_s": largest.get(
            "first_pull_bytes_per_s", largest["pull_bytes_per_s"]
        ),
    }
    for what in ("publish", "pull"):
        points = [(s["bytes"], s["bytes"] / s[f"{what}_bytes_per_s"]) for s in sizes]
        if len({x for x, _ in points}) > 1:
            fixed, per_byte = _fit_line(points)
            figures[f"{what}_fixed_s"] = fixed
            figures[f"{what}_bytes_per_s"] = (
                1 / per_byte if per_byte else largest[f"{what}_bytes_per_s"]
            )
    small = [r for run in runs for r in run.get("small", [])]
    if len({r["arrays"] for r in small}) > 1:  # per version and per array, bytes taken out
        for what, key, rate in (
            ("publish", "publish_s", figures["publish_bytes_per_s"]),
            ("pull", "first_pull_s", figures["first_pull_bytes_per_s"]),
        ):
            fixed, per_array = _fit_line([(r["arrays"], r[key] - r["bytes"] / rate) for r in small])
            figures[f"{what}_fixed_s"], figures[f"{what}_s_per_array"] = fixed, per_array
    mb = 2**20
    note = (
        f"param server: publish {figures['publish_bytes_per_s'] / mb:.0f} MB/s, pull "
        f"{figures['pull_bytes_per_s'] / mb:.0f} MB/s (first pull "
        f"{figures['first_pull_bytes_per_s'] / mb:.0f} MB/s); a version is "
        f"{workload.model_bytes / mb:.1f} MB"
    )
    if "publish_s_per_array" in figures:
        note += (
            f"; per version {figures['publish_fixed_s'] * 1e3:.1f} ms publish, "
            f"{figures['pull_fixed_s'] * 1e3:.1f} ms pull, per array "
            f"{figures['publish_s_per_array'] * 1e3:.2f} / {figures['pull_s_per_array'] * 1e3:.2f} "
            f"ms ({workload.model_arrays} arrays)"
        )
    return figures, note


def _pull_from_worker_loads(
    loads: list[dict], figures: Mapping[str, float], default: TimingModel
) -> tuple[dict, str]:
    """A worker's pull latency (per version, per array) from bench_inference's
    `worker_load`: the load of a just-published version, less its swap and its bytes at the
    first-pull rate (the parameter-server benchmark's, when given). The load is the served
    worker's (`served_load_s`: the Load RPC to a worker process, its pull and swap) where
    measured, else InferenceWorker.load in-process (`load_s`). It covers what the parameter
    server's own small-tree pulls do not: placing the arrays on the worker's devices and,
    served, the RPC and the process boundary."""
    rate = figures.get("first_pull_bytes_per_s", default.first_pull_bytes_per_s)
    served = all("served_load_s" in r for r in loads)
    key = "served_load_s" if served else "load_s"
    points = [(r["arrays"], max(0.0, r[key] - r["swap_s"] - r["bytes"] / rate)) for r in loads]
    fixed, per_array = _fit_line(points)
    note = (
        f"worker load ({'served' if served else 'in-process'}): pull {fixed * 1e3:.1f} ms per "
        f"version + {per_array * 1e3:.3f} ms per array before its bytes ({len(loads)} "
        "measured load(s))"
    )
    return {"pull_fixed_s": fixed, "pull_s_per_array": per_array}, note


def _from_verifier_bench(workload: Workload, runs: list[dict]) -> tuple[dict, str]:
    """The benchmark judges sandboxed code: its per-request service time (batch time ×
    workers / requests) and spread apply to code datasets only."""
    run = runs[-1]
    service = run["batch_s"] * run["workers"] / run["solutions"]
    spread = run["p95_s"] / run["p50_s"] if run["p50_s"] else 1.0
    if not workload.uses_code_verifier:
        return {}, (
            f"verifier: the benchmark's code-judging figures ({service:.2f} s per request) are "
            "not used: the run's datasets have no code verifier (cheap checks keep the default)"
        )
    return {"verify_p50_s": service, "verify_p95_s": service * spread}, (
        f"verifier: {service:.2f} s per code request (p95/p50 {spread:.2f})"
    )


def _from_hardware(workload: Workload, hw: HardwareSpec) -> tuple[dict, str]:
    """Roofline durations on the given chips."""
    m = workload.model
    params = count_params(m)
    ctx = workload.mean_context()
    figures: dict[str, float] = {}
    parts = [f"hardware {hw.name or '(unnamed)'}"]
    if hw.trainer_chips:
        seq = min(workload.max_seq_len, workload.prompt_tokens.mean() + workload.max_new_tokens)
        rate = hw.trainer_chips * hw.peak_flops_per_chip * hw.train_mfu
        figures["train_s_per_token"] = train_flops_per_token(m, seq) / rate
        figures["train_fixed_s"] = 0.0
        parts.append(f"trainer {hw.trainer_chips} chips at MFU {hw.train_mfu:.0%}")
    if hw.chips_per_worker:
        c = hw.chips_per_worker
        weights = params * hw.serve_dtype_bytes
        kv = workload.decode_slots * ctx * m.kv_bytes_per_token(hw.serve_dtype_bytes)
        memory_s = (weights + kv) / (
            c * hw.hbm_bytes_per_s_per_chip * hw.decode_bandwidth_efficiency
        )
        compute_s = (
            workload.decode_slots
            * decode_flops_per_token(m, ctx)
            / (c * hw.peak_flops_per_chip * hw.decode_flops_efficiency)
        )
        figures["decode_step_s"] = max(memory_s, compute_s)
        figures["decode_call_s"] = hw.decode_call_s
        figures["prefill_call_s"] = hw.prefill_call_s
        figures["prefill_s_per_token"] = decode_flops_per_token(m, ctx) / (
            c * hw.peak_flops_per_chip * hw.prefill_mfu
        )
        bound = "memory" if memory_s >= compute_s else "compute"
        parts.append(
            f"{c} chips per worker: decode step {figures['decode_step_s'] * 1e3:.1f} ms "
            f"({bound}-bound at {workload.decode_slots} slots, context {ctx:.0f})"
        )
    return figures, "; ".join(parts)
