"""Compile a config's programs for its topologies and report what they need per chip:
`compile_config` -> `CompileReport` (JSON for the simulator, `format_report` for people),
with the inference workers' KV capacity in sequences (`rlax_tpu.inference.capacity`)."""

from __future__ import annotations

import dataclasses
import functools

from jax.sharding import Mesh

from rlax_tpu.compile import executables
from rlax_tpu.compile.cost import program_cost, train_step_cost
from rlax_tpu.compile.measure import ProgramReport, compile_program, refusal
from rlax_tpu.compile.programs import (
    COMPONENT_OF,
    PROGRAMS,
    inference_programs,
    lora_savings,
    trainer_programs,
)
from rlax_tpu.compile.topology import gpu_devices, topology_mesh
from rlax_tpu.config import ConfigError, MeshConfig, RunConfig
from rlax_tpu.hardware import (
    CHIPS,
    FIT_FRACTION,
    GPUS,
    STATED_EFFICIENCY,
    ChipSpec,
    GiB,
    chip_of,
    compile_target,
    parse_gpu,
)
from rlax_tpu.inference.capacity import KvCapacity, kv_capacity
from rlax_tpu.sharding import build_mesh


@dataclasses.dataclass
class ComponentTarget:
    """Where a component's programs run: its topology (a TPU slice, or GPUs "h100:1"), how
    many slices of it, chip and mesh; which compiler measured them; the share of each chip's
    memory its process gets (a GPU's `gpu_memory_fraction`, shared with the run's other
    processes)."""

    name: str  # "trainer" | "inference"
    topology: str  # one slice's
    chip: ChipSpec
    num_chips: int  # of all its slices
    mesh: dict[str, int]
    compiler: str = "libtpu"  # "libtpu" | "XLA:GPU" | "XLA:CPU" (an estimate of a GPU program)
    memory_fraction: float = 1.0
    num_slices: int = 1
    dcn_axis: str = "data"  # the mesh axis across the slices (with num_slices > 1)
    rest_axis: str = ""  # the mesh axis the config sized -1 (the chips the others leave)

    @property
    def is_gpu(self) -> bool:
        return self.chip.name in GPUS

    @property
    def memory_bytes(self) -> int:
        """Per chip, what this component's programs may use."""
        return int(self.chip.hbm_bytes * self.memory_fraction)

    def mesh_text(self) -> str:
        """ "data 2 × fsdp 8 (-1) × tensor 4": the sizes, the one the config left to -1
        marked."""
        return " × ".join(
            f"{axis} {size}" + (" (-1)" if axis == self.rest_axis else "")
            for axis, size in self.mesh.items()
        )

    def placement(self) -> str:
        """Where the programs were compiled for, as a refusal names it: the mesh over the
        topology, the slices and the chips."""
        if self.is_gpu:
            return (
                f"the {self.name} mesh {self.mesh_text()} over {self.topology} "
                f"({self.num_chips} GPU{'s' if self.num_chips > 1 else ''})"
            )
        slices = (
            "1 slice"
            if self.num_slices == 1
            else f"{self.num_slices} slices, {self.dcn_axis} across them"
        )
        return (
            f"the {self.name} mesh {self.mesh_text()} over {self.topology} ({slices}; "
            f"{self.num_chips} chips)"
        )

    def mesh_note(self) -> str:
        """When the config's -1 axis came out at 1: the chips compiled for leave it nothing
        to shard over, the usual sign of a config compiled for a smaller slice than it was
        written for (a v5p-64 trainer on a v5p-8); "" otherwise."""
        axis = self.rest_axis
        # One chip: nothing to shard over whatever the axes; the placement says so.
        if not axis or self.mesh[axis] != 1 or self.num_chips == 1:
            return ""
        fixed = " × ".join(f"{a} {n}" for a, n in self.mesh.items() if a != axis)
        unit = "GPU" if self.is_gpu else "chip"
        where = (
            f"{self.name}.gpu"
            if self.is_gpu
            else f"{self.name}.mesh.topology, deploy.{self.name}_tpu, {self.name}.mesh.num_slices"
        )
        return (
            f"{self.name}.mesh.{axis}=-1 resolved to 1: the {self.num_chips} {unit}s of "
            f"{self.topology}"
            + (f" × {self.num_slices} slices" if self.num_slices > 1 else "")
            + f" are all taken by {fixed}, so nothing is sharded along {axis} and every "
            f"{unit} holds what {axis} would have split. If the config was written for a "
            f"larger slice, compile for that one ({where}); else shrink {fixed}"
        )

    def to_json(self) -> dict:
        return {
            "topology": self.topology,
            "num_slices": self.num_slices,
            "dcn_axis": self.dcn_axis,
            "chip": self.chip.name,
            "num_chips": self.num_chips,
            "mesh": self.mesh,
            "compiler": self.compiler,
            "memory_fraction": self.memory_fraction,
            "memory_bytes_per_chip": self.memory_bytes,
            "hbm_bytes_per_chip": self.chip.hbm_bytes,
            "peak_flops_per_s": self.chip.peak_flops_per_s,
            "hbm_bytes_per_s": self.chip.hbm_bytes_per_s,
        }


@dataclasses.dataclass
class CompileReport:
    config_name: str
    config_digest: str
    components: dict[str, ComponentTarget]
    programs: list[ProgramReport]
    problems: list[str]
    # One inference worker's KV pool in tokens and concurrent sequences (None: no inference
    # program compiled).
    kv_capacity: KvCapacity | None = None
    # One train step's FLOPs, time and MFU (cost.train_step_cost; None: not both compiled).
    train_step: dict | None = None
    # With model.lora: what it saves the trainer against full fine-tuning
    # (programs.lora_savings; None without LoRA or without a trainer program).
    lora: dict | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def train_step_roofline_s(self) -> float | None:
        """One train step = recompute (π_old, and the reference's) + rl_step; None unless
        both compiled."""
        step = [p for p in self.programs if p.name in ("rl_step", "recompute")]
        if len(step) != 2 or any(p.error for p in step):
            return None
        return sum(p.roofline_s * p.calls_per_step for p in step)

    def to_json(self) -> dict:
        return {
            "config": self.config_name,
            "config_digest": self.config_digest,
            "fit_fraction": FIT_FRACTION,
            "fits": self.fits,
            "problems": self.problems,
            "components": {k: c.to_json() for k, c in self.components.items()},
            "programs": [p.to_json() for p in self.programs],
            "train_step_roofline_s": self.train_step_roofline_s,
            "train_step": self.train_step,
            "kv_capacity": self.kv_capacity.to_json() if self.kv_capacity else None,
            "lora": self.lora,
            "chips": {k: c.to_json() for k, c in CHIPS.items()},
        }


def _gpu_target(config: RunConfig, component: str) -> tuple[ComponentTarget, Mesh]:
    """`component` on its GPUs (`<component>.gpu`), with its gpu_memory_fraction of each."""
    section = getattr(config, component)
    model, count = parse_gpu(section.gpu)
    if model not in GPUS:
        raise ConfigError(
            f"unknown GPU {model!r}; rlax-tpu compile knows {', '.join(GPUS)} "
            "(rlax_tpu/hardware.py)",
            field=f"{component}.gpu",
        )
    devices, compiler = gpu_devices(count)
    mesh = build_mesh(section.mesh, devices=devices)
    target = ComponentTarget(
        component,
        compile_target(config, component),
        GPUS[model],
        mesh.size,
        dict(mesh.shape),
        compiler=compiler,
        memory_fraction=section.gpu_memory_fraction,
        rest_axis=_rest_axis(section.mesh),
    )
    return target, mesh


def _rest_axis(mesh: MeshConfig) -> str:
    """The axis `mesh` sizes -1 ("" when every size is fixed)."""
    return next((axis for axis in mesh.AXES if getattr(mesh, axis) == -1), "")


def _target(config: RunConfig, component: str) -> tuple[ComponentTarget, Mesh]:
    """Where `component`'s programs run, and its mesh over the topology's abstract devices
    (or over the devices its GPU programs are compiled for)."""
    if getattr(config, component).gpu:
        return _gpu_target(config, component)
    topology = config.tpu_topology(component)
    if not topology:
        slice_ = getattr(config.deploy, f"{component}_tpu")
        raise ConfigError(
            f"no TPU topology for the {component}: set {component}.mesh.topology (like "
            f"v5p:2x2x1), or deploy.{component}_tpu.accelerator to a known TPU accelerator "
            f"(got {slice_.accelerator!r}), or {component}.gpu to its GPUs (like h100)",
            field=f"{component}.mesh.topology",
        )
    mesh_config = getattr(config, component).mesh
    mesh = topology_mesh(mesh_config, topology)
    target = ComponentTarget(
        component,
        topology,
        chip_of(topology),
        mesh.size,
        dict(mesh.shape),
        num_slices=mesh_config.num_slices,
        dcn_axis=mesh_config.dcn_axis,
        rest_axis=_rest_axis(mesh_config),
    )
    return target, mesh


def compile_config(
    config: RunConfig,
    programs: tuple[str, ...] | None = None,
    *,
    progress=None,
    save_dir: str | None = None,
) -> CompileReport:
    """Compile `programs` (default: all the run executes) of `config` for its topologies.

    progress: called with each ProgramReport as it completes (the CLI prints a line).
    save_dir: keep the compiled executables there, for `trainer.compiled_dir` and
    `inference.compiled_dir` (rlax_tpu.compile.executables)."""
    names = set(programs or PROGRAMS)
    unknown = names - set(PROGRAMS)
    if unknown:
        raise ValueError(f"unknown programs {sorted(unknown)}; choose from {list(PROGRAMS)}")
    components = {}
    reports: list[ProgramReport] = []
    savings = None
    for component, build in (("trainer", trainer_programs), ("inference", inference_programs)):
        if not any(COMPONENT_OF[n] == component for n in names):
            continue
        target, mesh = _target(config, component)
        components[component] = target
        if component == "trainer" and config.model.lora is not None:
            savings = lora_savings(config, mesh)
        for program in build(config, mesh, names):
            keep = None
            if save_dir and program.lower is not None:
                keep = functools.partial(
                    executables.save,
                    save_dir,
                    program.key,
                    mesh=mesh,
                    config_digest=config.digest(),
                )
            report = compile_program(
                program, target.chip, memory_bytes=target.memory_bytes, keep=keep
            )
            if not report.error:
                report.cost = program_cost(
                    report.name,
                    report.dims,
                    report.flops,
                    report.roofline_s,
                    config=config,
                    chip=target.chip,
                    num_chips=target.num_chips,
                )
            reports.append(report)
            if progress is not None:
                progress(report)
    problems = [refusal(r, config, components[r.component]) for r in reports if not r.fits]
    capacity = kv_capacity(config.model, config.inference) if "inference" in components else None
    step = None
    if "trainer" in components:
        step = train_step_cost(reports, config, components["trainer"].chip)
    return CompileReport(
        config.name,
        config.digest(),
        components,
        reports,
        problems,
        capacity,
        train_step=step,
        lora=savings,
    )


def format_report(report: CompileReport) -> str:
    """The report as tables: memory per chip by kind, then FLOPs, bytes and times."""
    lines = []
    for target in report.components.values():
        mesh = " × ".join(f"{k} {v}" for k, v in target.mesh.items())
        chip = target.chip
        if not target.is_gpu:
            where = f"{target.topology} ({target.num_chips} chips; mesh {mesh})"
            if target.num_slices > 1:
                where = (
                    f"{target.num_slices} slices of {target.topology} ({target.num_chips} "
                    f"chips; mesh {mesh}, {target.dcn_axis} across the slices over DCN)"
                )
            lines.append(
                f"{target.name}: {where}; "
                f"per chip {chip.hbm_bytes / GiB:.0f} GiB HBM, "
                f"{chip.peak_flops_per_s / 1e12:.0f} TFLOP/s bf16, "
                f"{chip.hbm_bytes_per_s / 1e12:.2f} TB/s"
            )
            continue
        lines.append(
            f"{target.name}: {target.num_chips} × {chip.name} GPU (mesh {mesh}); per GPU "
            f"{chip.hbm_bytes / GiB:.1f} GiB, of which this process gets "
            f"{target.name}.gpu_memory_fraction={target.memory_fraction:g}: "
            f"{target.memory_bytes / GiB:.1f} GiB (the 'per chip' and 'of HBM' columns); "
            f"{chip.peak_flops_per_s / 1e12:.0f} TFLOP/s bf16, "
            f"{chip.hbm_bytes_per_s / 1e12:.2f} TB/s"
        )
        if target.compiler == "XLA:CPU":
            attention = (
                "Training attention is counted as the reference (float32 scores [rows, "
                "heads, seq, seq] per layer) where the GPU runs cuDNN's fused attention, "
                "which keeps none."
                if target.name == "trainer"
                else "Attention is the JAX paged path, as `auto` runs it on a GPU."
            )
            lines.append(
                "  ESTIMATE: no GPU here, so the GPU program was compiled by XLA:CPU for "
                f"{target.num_chips} CPU device(s), same shapes and sharding; XLA:GPU fuses "
                f"and assigns buffers differently. {attention} Compile on a GPU with "
                "--on-gpu for the real figures."
            )
        else:
            lines.append(f"  compiled by {target.compiler} on this machine's GPUs")
    if report.kv_capacity is not None:
        lines.extend(format_kv_capacity(report.kv_capacity))
    columns = (
        ("params", "params"),
        ("optimizer_state", "opt"),
        ("reference", "ref"),
        ("gradients", "grads"),
        ("activations_and_temporaries", "act+tmp"),
        ("kv_cache", "kv"),
        ("inputs", "inputs"),
        ("outputs", "outputs"),
        ("generated_code", "code"),
        ("total", "total"),
    )
    lines.append("")
    width = max([21, *(len(p.label) + 1 for p in report.programs)])
    big = any(p.total >= GiB for p in report.programs)
    unit, scale = ("GiB", GiB) if big else ("MiB", 2**20)
    header = f"{unit + ' per chip':<{width}}" + "".join(f"{label:>9}" for _, label in columns)
    lines.append(header + f"{'of HBM':>8}  fits")
    for p in report.programs:
        name = p.label
        if p.error and not p.out_of_memory:
            lines.append(f"{name:<{width}}  failed: {p.error}")
            continue
        cells = "".join(f"{p.memory.get(key, 0) / scale:>9.2f}" for key, _ in columns)
        note = "no (compiler: out of HBM)" if p.out_of_memory else ("yes" if p.fits else "NO")
        lines.append(f"{name:<{width}}{cells}{p.hbm_fraction:>8.0%}  {note}")
    lines.append("")
    lines.append(
        f"{'per chip, per call':<{width}}{'TFLOP':>9}{'model':>9}{'GB':>9}{'roofline':>11}"
        f"{'bound':>8}{'est.':>11}{'MFU':>7}{'lower':>8}{'compile':>9}  shape"
    )
    for p in report.programs:
        name = p.label
        if p.error or p.lower_s == 0:  # failed, or nothing compiled (the sharded load)
            lines.append(
                f"{name:<{width}}{'':>64}{p.lower_s:>7.1f}s{p.compile_s:>8.1f}s  {p.shape}"
            )
            continue
        cost = p.cost
        mfu = cost.get("mfu_estimated")
        lines.append(
            f"{name:<{width}}{_number(p.flops / 1e12):>9}"
            f"{_number(cost.get('model_flops', 0) / 1e12) if cost.get('model_flops') else '–':>9}"
            f"{_number(p.bytes_accessed / 1e9):>9}{_seconds(p.roofline_s):>11}{p.bound:>8}"
            f"{_seconds(cost.get('estimated_s', 0)):>11}"
            f"{f'{mfu:.0%}' if mfu is not None else '–':>7}"
            f"{p.lower_s:>7.1f}s{p.compile_s:>8.1f}s  {p.shape}"
        )
    efficiency = ", ".join(f"{k} {v:.0%}" for k, v in STATED_EFFICIENCY.items())
    lines.append(
        f"(model: the architecture's FLOPs for the program's tokens; est.: the roofline at the "
        f"stated efficiency ({efficiency} of it); MFU: model FLOPs / (peak × est.))"
    )
    notes = [
        f"{p.name}: {p.hlo['kernels_without_cost']} Pallas kernel call(s) without a cost "
        "estimate (paged attention): their FLOPs are not counted"
        for p in report.programs
        if p.hlo.get("kernels_without_cost")
    ]
    estimated = {n for n, t in report.components.items() if t.compiler == "XLA:CPU"}
    notes += [
        f"{p.name}: its temporaries hold two copies of the KV pool "
        f"({2 * p.memory['kv_cache'] / GiB:.2f} GiB of act+tmp): the pool is written out of "
        "place (the JAX paged-attention path does so on XLA:CPU and libtpu alike; the TPU "
        "kernel updates it in place), so it costs three times inference.kv_cache_bytes"
        for p in report.programs
        if p.memory.get("kv_cache") and p.memory.get("temp", 0) >= 2 * p.memory["kv_cache"]
    ]
    if estimated:
        notes.append(
            "XLA:CPU estimate: FLOPs count the program's matmuls; bytes and rooflines are "
            "XLA:CPU's (its fusion and copies), not a GPU's"
        )
    step = report.train_step
    if step is not None:
        extra = step["extra_flops"]
        lines.append(
            f"train step (recompute × calls + rl_step), per chip: model "
            f"{_number(step['model_flops'] / 1e12)} TFLOP, compiled "
            f"{_number(step['compiled_flops'] / 1e12)} TFLOP "
            f"(×{step['compiled_over_model']:.2f}: rl_step beyond the model "
            f"{_number(extra['rl_step_beyond_model'] / 1e12)} (remat, loss, optimizer), π_old "
            f"{_number(extra['pi_old'] / 1e12)}, reference {_number(extra['reference'] / 1e12)}); "
            f"roofline {_seconds(step['roofline_s'])}, estimated {_seconds(step['estimated_s'])} "
            f"at {step['efficiency']:.0%} of it: MFU {step['mfu_estimated']:.1%} "
            f"({step['mfu_at_roofline']:.1%} at the roofline)"
        )
    lines.extend(dict.fromkeys(notes))  # a note of every bucket of a program once
    if report.lora is not None:
        lines.append(format_lora_savings(report.lora))
    lines.append("")
    share = (
        " (a GPU process: of its share)"
        if any(t.is_gpu for t in report.components.values())
        else ""
    )
    lines.append(
        f"fits: every program within {FIT_FRACTION:.0%} of HBM{share}"
        if report.fits
        else "DOES NOT FIT:\n" + "\n".join(f"  {p}" for p in report.problems)
    )
    return "\n".join(lines)


def format_lora_savings(lora: dict) -> str:
    """One line: what LoRA trains and saves per trainer chip against full fine-tuning."""
    held, full = lora["bytes_per_chip"], lora["full_fine_tuning_bytes_per_chip"]
    kinds = ", ".join(
        f"{kind.replace('_', ' ')} {_size(held[kind])} (full: {_size(full[kind])})"
        for kind in ("optimizer_state", "gradients", "reference")
        if full[kind]
    )
    return (
        f"LoRA rank {lora['rank']} on {', '.join(lora['targets'])}: trains "
        f"{lora['trained_params']:,} of {lora['total_params']:,} parameters "
        f"({lora['trained_params'] / lora['total_params']:.2%}); per trainer chip {kinds}: "
        f"{_size(lora['saved_bytes_per_chip'])} less than full fine-tuning"
    )


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def format_kv_capacity(c: KvCapacity) -> list[str]:
    """Lines of one worker's KV capacity: its pool, and the sequences it holds at once under
    each admission (the config's marked)."""

    def used(admission: str) -> str:
        return " (in use)" if c.admission == admission else ""

    bound = "decode slots" if c.limited_by == "decode_slots" else "KV pages"
    ratio = c.on_demand_over_reserved
    return [
        f"inference KV pool, per worker: {c.tokens:,} tokens ({c.usable_pages:,} pages of "
        f"{c.page_size}; {_kib(c.bytes_per_token)} a token)",
        f"  on_demand{used('on_demand')}: {c.concurrent_sequences_on_demand} concurrent "
        f"sequences (bound: {bound}) at the expected lengths, prompt mean "
        f"{c.expected_prompt_tokens:,.0f} and response mean {c.expected_response_tokens:,.0f} "
        f"tokens: {c.mean_live_tokens_per_sequence:,.0f} KV tokens a live sequence",
        f"  reserve{used('reserve')}: {c.concurrent_sequences_reserved} concurrent sequences "
        f"of {c.reserved_tokens_per_sequence:,} reserved tokens"
        + (f"; on_demand holds {ratio:.1f}×" if ratio is not None else ""),
    ]


def _kib(n: int) -> str:
    return f"{n / 2**10:.3g} KiB" if n < 2**20 else f"{n / 2**20:.3g} MiB"


def _number(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"
