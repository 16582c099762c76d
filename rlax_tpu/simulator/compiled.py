"""Step costs from an `rlax-tpu compile --json` report (rlax_tpu.compile): the rooflines of
the trainer's step and of the inference worker's prefill and decode calls, compiled by
libtpu for the config's own TPU topologies, turned into TimingModel figures.

A roofline (max of FLOPs/peak and HBM bytes/bandwidth, per chip, from the compiled HLO) is
a lower bound, so each is divided by the fraction of it the run is taken to reach
(`HardwareSpec.compiled_*_efficiency`: explicit, overridable). `calibrate` applies these
figures after the hardware figures and before explicit settings. Pure Python like the
rest of the simulator: it reads the report, it never compiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlax_tpu.config import ConfigError, RunConfig
from rlax_tpu.hardware import compile_target
from rlax_tpu.simulator.model import CalibrationError, HardwareSpec, Workload

_REDO = "compile this config again: rlax-tpu compile CONFIG [--set …] --json OUT"


# The figures of each program's `dims` (rlax_tpu.compile.programs) the simulator reads.
_DIMS = {
    "rl_step": ("rows", "seq_len"),
    "recompute": ("rows", "seq_len"),
    "prefill": ("rows", "seq_len"),
    "decode": ("slots", "steps"),
}


def _shape(program: Mapping[str, Any], source: str) -> tuple[int, int]:
    """(rows, tokens) of rl_step, recompute and prefill; (slots, tokens per call) of decode."""
    dims = program.get("dims") or {}
    keys = _DIMS[program["name"]]
    if not all(isinstance(dims.get(k), int) for k in keys):
        raise CalibrationError(
            f"{source}: the {program['name']} program's dims {dims!r} lack {list(keys)} "
            "(a report of another rlax-tpu version?); " + _REDO
        )
    return dims[keys[0]], dims[keys[1]]


def check_report(
    config: RunConfig, workload: Workload, report: Mapping[str, Any], source: str
) -> str:
    """Refuse (CalibrationError) a report compiled for another config; say what matched.

    The report records the config's name and digest, each component's topology and mesh,
    and each program's shape. The name must match. A digest that differs (the config was
    changed since, e.g. by --set inference.num_workers=… in a sweep) is accepted when
    everything else the report records matches this config: the topologies, the meshes,
    the trainer's rows × max_seq_len, prefill's rows × largest bucket, decode's slots.
    Settings it does not record (model dimensions, dtypes, memory knobs) cannot be checked.
    """
    name, digest = report.get("config"), str(report.get("config_digest", ""))
    if name != config.name:
        raise CalibrationError(
            f"{source}: this compile report is of config {name!r}, not {config.name!r}; " + _REDO
        )
    if digest == config.digest():
        return f"config {name}, digest {digest[:12]} (this config)"
    problems = []
    for component, target in report.get("components", {}).items():
        topology = compile_target(config, component)
        if target["topology"] != topology:
            problems.append(
                f"the {component} was compiled for {target['topology']}, this config runs it "
                f"on {topology or 'no TPU topology'} ({component}.mesh.topology, "
                f"{component}.gpu)"
            )
            continue
        slices = getattr(config, component).mesh.num_slices
        if target.get("num_slices", 1) != slices:
            problems.append(
                f"the {component} was compiled for {target.get('num_slices', 1)} slice(s) of "
                f"{topology}, this config runs it on {slices} ({component}.mesh.num_slices)"
            )
            continue
        try:
            mesh = getattr(config, component).mesh.shape_for(target["num_chips"])
        except ConfigError:
            mesh = None
        if mesh != target["mesh"]:
            problems.append(
                f"the {component} mesh was {target['mesh']}, this config's is {mesh} "
                f"({component}.mesh)"
            )
    expected = {
        "rl_step": (
            (workload.batch_size, workload.max_seq_len),
            "rows × tokens (controller.prompts_per_batch × samples_per_prompt, "
            "trainer.max_seq_len)",
        ),
        "prefill": (
            (workload.prefill_rows, workload.prefill_buckets[-1]),
            "rows × tokens (inference.prefill_batch_size, the largest inference.prefill_buckets)",
        ),
        "decode": ((workload.decode_slots,), "slots (inference.max_decode_slots)"),
    }
    expected["recompute"] = expected["rl_step"]
    for program in report.get("programs", []):
        if program["name"] not in expected:
            continue
        want, what = expected[program["name"]]
        got = _shape(program, source)[: len(want)]
        if got != want:
            problems.append(
                f"{program['name']} was compiled for {' × '.join(map(str, got))} {what}, this "
                f"config has {' × '.join(map(str, want))}"
            )
    if problems:
        raise CalibrationError(
            f"{source}: this compile report is of another version of config {name!r} (digest "
            f"{digest[:12]}, this config's {config.digest()[:12]}): "
            + "; ".join(problems)
            + "; "
            + _REDO
        )
    return (
        f"config {name}, digest {digest[:12]} ≠ this config's {config.digest()[:12]}: the "
        "topologies, meshes and program shapes it records match; settings it does not record "
        "(model dimensions, dtypes, memory knobs) are not checked"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def from_compile_report(
    config: RunConfig,
    workload: Workload,
    report: Mapping[str, Any],
    hardware: HardwareSpec,
    source: str,
) -> tuple[dict[str, float], list[str]]:
    """TimingModel figures from `report`'s rooflines, and one note per figure group naming
    its source. A program that is missing or did not compile gives no figure (said so).

    * trainer: train_s_per_token = train_step_roofline_s (rl_step + recompute × its calls)
      / compiled_train_efficiency / (rows × max_seq_len, the tokens the compiled step
      trains; packed, rows × trainer.tokens_per_row: the compiled step counts every packed
      micro-batch as used); train_fixed_s = 0 (a roofline has no fixed part);
    * prefill: prefill_s_per_token = roofline / compiled_prefill_efficiency / (rows ×
      largest bucket) (exact at the compiled bucket, linear below it);
    * decode: decode_step_s = roofline / compiled_decode_efficiency / tokens per call (one
      call of every slot, as compiled: it reads what the program reads, the whole KV cache
      for the paged-attention kernel, whatever the context).
    Per-call host costs (decode_call_s, prefill_call_s) are not in a compiled program: they
    stay with the other sources.
    """
    estimated = sorted(
        c for c, t in report.get("components", {}).items() if t.get("compiler") == "XLA:CPU"
    )
    if estimated:
        raise CalibrationError(
            f"{source}: the {' and '.join(estimated)} programs of this report were compiled by "
            "XLA:CPU as an estimate of GPU programs: their memory, not their time (XLA:CPU's "
            "fusion and copies are not the GPU's, so its bytes and rooflines are not). Time "
            "a GPU by hardware figures (a `hardware:` settings file, e.g. "
            "configs/simulator/h100.yaml), a benchmark, or a report compiled on a GPU "
            "(rlax-tpu compile --on-gpu)"
        )
    head = (
        f"compile report {source} ({check_report(config, workload, report, source)}); the "
        "per-call host costs (decode_call_s, prefill_call_s) are not in a compiled program"
    )
    # By name; a program compiled at several buckets (prefill, decode) appears once per
    # bucket in ascending order, so the last, the largest, is the one kept.
    programs = {p["name"]: p for p in report["programs"]}
    components = report.get("components", {})

    def where(component: str) -> str:
        target = components.get(component, {})
        return f"{target.get('topology', '?')}, {target.get('num_chips', '?')} chips"

    def missing(names: tuple[str, ...]) -> str:
        for n in names:
            if n not in programs:
                return f"{n} is not in the report (compiled with --programs?)"
            if programs[n].get("error"):
                return f"{n} did not compile ({programs[n]['error']})"
        return ""

    figures: dict[str, float] = {}
    notes = [head]
    why = missing(("rl_step", "recompute"))
    if why or report.get("train_step_roofline_s") is None:
        notes.append(f"{source}: no trainer figures: {why or 'no train step roofline'}")
    else:
        step_s, eff = float(report["train_step_roofline_s"]), hardware.compiled_train_efficiency
        rows, seq = _shape(programs["rl_step"], source)
        # Packed, its roofline counts every packed micro-batch as used: rows packed rows.
        seq = workload.tokens_per_row or seq
        figures["train_s_per_token"] = step_s / eff / (rows * seq)
        figures["train_fixed_s"] = 0.0
        notes.append(
            f"{source}: train_s_per_token {figures['train_s_per_token']:.3g} s, train_fixed_s 0: "
            f"the train step's roofline {_ms(step_s)} (rl_step + recompute × "
            f"{programs['recompute']['calls_per_step']}, {programs['rl_step']['bound']}-bound; "
            f"{rows} × {seq} {'packed ' if workload.tokens_per_row else ''}tokens on "
            f"{where('trainer')}) at {eff:.0%} of it "
            "(hardware.compiled_train_efficiency)"
        )
    why = missing(("prefill",))
    if why:
        notes.append(f"{source}: no prefill figure: {why}")
    else:
        p, eff = programs["prefill"], hardware.compiled_prefill_efficiency
        rows, bucket = _shape(p, source)
        figures["prefill_s_per_token"] = p["roofline_s"] / eff / (rows * bucket)
        notes.append(
            f"{source}: prefill_s_per_token {figures['prefill_s_per_token']:.3g} s: the prefill "
            f"call's roofline {_ms(p['roofline_s'])} ({p['bound']}-bound; {rows} × {bucket} "
            f"tokens on {where('inference')}) at {eff:.0%} of it "
            "(hardware.compiled_prefill_efficiency)"
        )
    why = missing(("decode",))
    if why:
        notes.append(f"{source}: no decode figure: {why}")
    else:
        p, eff = programs["decode"], hardware.compiled_decode_efficiency
        slots, k = _shape(p, source)
        figures["decode_step_s"] = p["roofline_s"] / eff / k
        uncounted = p.get("hlo", {}).get("kernels_without_cost", 0)
        notes.append(
            f"{source}: decode_step_s {_ms(figures['decode_step_s'])}: the decode call's "
            f"roofline {_ms(p['roofline_s'])} ({p['bound']}-bound; {slots} slots × {k} "
            f"token(s) on {where('inference')}) at {eff:.0%} of it "
            "(hardware.compiled_decode_efficiency)"
            + (
                f"; {uncounted} kernel call(s) without a cost estimate: their FLOPs are not "
                "counted, their operands' bytes are"
                if uncounted
                else ""
            )
        )
    if not report.get("fits", True):
        problems = report.get("problems") or ["(no reason recorded)"]
        notes.append(f"{source}: the report says the config does not fit: {problems[0]}")
    return figures, notes
