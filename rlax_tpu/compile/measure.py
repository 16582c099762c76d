"""Compile one program for its topology and read what it costs per chip.

Memory comes from the compiler's buffer assignment (`compiled.memory_analysis()`, per
device): arguments (live for the whole call), outputs, the part of the outputs aliased to
donated arguments (written in place: no extra memory), temporaries (activations, gradients,
everything the program allocates inside) and the generated code. A program needs

    total = arguments + (outputs - aliased) + temporaries + generated code + resident

of one chip's HBM, `resident` being what the component holds beside the program while it
runs (the reference copy during a train step, the optimizer state during a publish).
Arguments are split by what they are (params, optimizer state, KV cache: from their
shardings; the rest is the batch); temporaries into the gradient tree (one param-shaped
float32 tree: the accumulator of `rl_step` / `sft_step`) and the activations and other
temporaries. A program with nothing to compile (the sharded checkpoint load) is sized from
its shardings alone. FLOPs and bytes come from the HLO walk of `hlo_cost`
(loops counted as often as they run); XLA's own figures are kept next to them.
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from collections.abc import Callable
from typing import Any

from rlax_tpu.compile.executables import compile_to_save
from rlax_tpu.compile.hlo_cost import analyze
from rlax_tpu.compile.programs import Program
from rlax_tpu.config import RunConfig
from rlax_tpu.hardware import FIT_FRACTION, GPUS, ChipSpec, GiB

# Config knobs that shrink each kind of memory, per component (named in the refusal).
KNOBS = {
    "trainer": {
        "params": "trainer.mesh (shard over more chips: fsdp), model.param_dtype",
        "optimizer_state": "trainer.mesh (shard over more chips: fsdp), model.param_dtype",
        "gradients": "trainer.mesh (shard over more chips: fsdp), model.param_dtype",
        "activations_and_temporaries": (
            "trainer.micro_batch_size, trainer.remat_policy (full keeps least), "
            "trainer.logprob_chunk_size, trainer.attention_backend, trainer.scan_layers, "
            "trainer.max_seq_len, trainer.tokens_per_row (packed rows)"
        ),
        "inputs": (
            "trainer.max_seq_len, the global batch (controller.prompts_per_batch × "
            "samples_per_prompt), trainer.mesh (data/fsdp shard the batch)"
        ),
        "outputs": "trainer.mesh",
        "generated_code": "trainer.scan_layers",
        "reference": (
            "trainer.algorithm (an objective without reference log-probs keeps no reference "
            "copy), trainer.mesh (shard over more chips: fsdp)"
        ),
    },
    "inference": {
        "params": (
            "inference.mesh (more tensor parallelism), model.publish_dtype, "
            "inference.weight_dtype (int8 / fp8 projections)"
        ),
        "kv_cache": "inference.kv_cache_bytes, inference.mesh (tensor shards the KV heads)",
        "activations_and_temporaries": (
            "inference.max_decode_slots, inference.prefill_batch_size, "
            "inference.prefill_buckets, inference.max_prompt_len + max_new_tokens, "
            "inference.attention_backend"
        ),
        "inputs": "inference.max_decode_slots, inference.prefill_batch_size",
        "outputs": "inference.max_decode_slots",
        "generated_code": "inference.prefill_buckets",
    },
}
CATEGORIES = (
    "params",
    "optimizer_state",
    "reference",
    "gradients",
    "activations_and_temporaries",
    "kv_cache",
    "inputs",
    "outputs",
    "generated_code",
)


@dataclasses.dataclass
class ProgramReport:
    name: str
    component: str
    shape: str
    calls: str
    calls_per_step: int
    chip: str
    memory: dict[str, int]  # per chip: CATEGORIES + total, compiler_peak and the raw figures
    hbm_bytes: int  # what the program may use per chip: the HBM, or a GPU process's share
    flops: float = 0.0  # per chip, per call
    bytes_accessed: float = 0.0
    roofline_s: float = 0.0
    bound: str = ""
    lower_s: float = 0.0
    compile_s: float = 0.0
    hlo: dict[str, Any] = dataclasses.field(default_factory=dict)
    xla_cost_analysis: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""  # the compiler's refusal (RESOURCE_EXHAUSTED) or another failure
    out_of_memory: bool = False
    dims: dict[str, int] = dataclasses.field(default_factory=dict)  # Program.dims
    # Model FLOPs, MFU and the estimated time (rlax_tpu.compile.cost; {} until costed).
    cost: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        """ "trainer rl_step"; with its bucket where a program runs at several
        ("inference decode@64", "inference prefill@512", "inference extend@512")."""
        bucket = {"prefill": "seq_len", "extend": "seq_len", "decode": "slots"}.get(self.name)
        at = f"@{self.dims[bucket]}" if bucket and bucket in self.dims else ""
        return f"{self.component} {self.name}{at}"

    @property
    def total(self) -> int:
        return self.memory.get("total", 0)

    @property
    def hbm_fraction(self) -> float:
        return self.total / self.hbm_bytes

    @property
    def fits(self) -> bool:
        return not self.error and self.total <= FIT_FRACTION * self.hbm_bytes

    def biggest(self) -> tuple[str, int]:
        parts = {k: self.memory.get(k, 0) for k in CATEGORIES}
        name = max(parts, key=parts.get)
        return name, parts[name]

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(fits=self.fits, hbm_fraction=self.hbm_fraction)
        return out


def _memory(stats: Any, program: Program) -> dict[str, int]:
    argument = int(stats.argument_size_in_bytes)
    output = int(stats.output_size_in_bytes)
    alias = int(stats.alias_size_in_bytes)
    temp = int(stats.temp_size_in_bytes)
    code = int(stats.generated_code_size_in_bytes)
    known = {k: v for k, v in program.arguments.items() if v}
    # Arguments the program never reads (the optimizer's init reads only the params'
    # shapes) may be left out of the compiler's count; they are on the chip all the same.
    argument = max(argument, sum(known.values()))
    gradients = min(program.gradients, temp)
    memory = {k: 0 for k in CATEGORIES}
    memory.update(known)
    memory.update(
        gradients=gradients,
        activations_and_temporaries=temp - gradients,
        inputs=max(argument - sum(known.values()), 0),
        outputs=max(output - alias, 0),
        generated_code=code,
    )
    for kind, size in program.resident.items():
        memory[kind] += size
    memory.update(
        total=argument + max(output - alias, 0) + temp + code + sum(program.resident.values()),
        compiler_peak=int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
        argument=argument,
        output=output,
        alias=alias,
        temp=temp,
    )
    return memory


_REQUIRED = re.compile(r"memory required for (.+?) \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _out_of_memory(message: str, program: Program) -> dict[str, int]:
    """What a RESOURCE_EXHAUSTED message says the program needs, as a memory breakdown:
    the figure it names (HLO temporaries, usually) on top of the known arguments."""
    memory = {k: 0 for k in CATEGORIES}
    memory.update({k: v for k, v in program.arguments.items() if v})
    for kind, size in program.resident.items():
        memory[kind] += size
    m = _REQUIRED.search(message)
    if m:
        required = int(float(m.group(2)) * _UNITS[m.group(3)])
        if "argument" in m.group(1):
            memory["inputs"] = max(required - sum(program.arguments.values()), 0)
        else:  # HLO temporaries, usually
            memory["activations_and_temporaries"] = required
    memory["total"] = sum(memory[k] for k in CATEGORIES)
    return memory


def compile_program(
    program: Program,
    chip: ChipSpec,
    *,
    memory_bytes: int | None = None,
    keep: Callable[[Any, Any], None] | None = None,
) -> ProgramReport:
    """Lower and compile `program` for `chip`'s topology (or the devices its mesh is over);
    its memory, FLOPs and timings. memory_bytes: what it may use per chip (default the
    chip's HBM; a GPU process's share of it). keep: called with (lowered, compiled) when it
    compiles (`--save-compiled`)."""
    report = ProgramReport(
        program.name,
        program.component,
        program.shape,
        program.calls,
        program.calls_per_step,
        chip.name,
        {},
        chip.hbm_bytes if memory_bytes is None else memory_bytes,
        dims=dict(program.dims),
    )
    if program.lower is None:  # nothing to compile: sized from its shardings
        report.memory = {k: program.resident.get(k, 0) for k in CATEGORIES}
        report.memory["total"] = sum(program.resident.values())
        return report
    start = time.perf_counter()
    with warnings.catch_warnings():
        # Donated buffers the compiler could not reuse (the optimizer's step counters) are
        # expected; the memory figures say what donation saved.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = program.lower()
        report.lower_s = time.perf_counter() - start
        start = time.perf_counter()
        try:  # one to keep is compiled whole, past the compilation cache
            compiled = compile_to_save(lowered) if keep is not None else lowered.compile()
        except Exception as e:  # XLA's JaxRuntimeError; others are reported the same way
            report.compile_s = time.perf_counter() - start
            message = str(e)
            report.error = message.splitlines()[0] if message else type(e).__name__
            report.out_of_memory = "RESOURCE_EXHAUSTED" in message
            report.memory = _out_of_memory(message, program) if report.out_of_memory else {}
            return report
    report.compile_s = time.perf_counter() - start
    if keep is not None:
        keep(lowered, compiled)
    report.memory = _memory(compiled.memory_analysis(), program)
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    report.xla_cost_analysis = {
        k: float(xla[k])
        for k in ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
        if k in (xla or {})
    }
    cost = analyze(compiled.as_text())
    report.hlo = cost.to_json()
    report.flops, report.bytes_accessed = cost.flops, cost.bytes_accessed
    compute_s = cost.flops / chip.peak_flops_per_s
    memory_s = cost.bytes_accessed / chip.hbm_bytes_per_s
    report.roofline_s = max(compute_s, memory_s)
    report.bound = "compute" if compute_s >= memory_s else "memory"
    return report


# A config field named in KNOBS ("trainer.max_seq_len"); its value is quoted in a refusal.
_KNOB = re.compile(r"\b(?:model|trainer|inference|controller)(?:\.\w+)+")


def _current_values(knobs: str, config: RunConfig) -> str:
    """`name=value` of each scalar config field `knobs` names (not meshes or tuples)."""
    values = []
    for name in dict.fromkeys(_KNOB.findall(knobs)):
        value: Any = config
        for part in name.split("."):
            value = getattr(value, part, None)
        if isinstance(value, (bool, int, float, str)):
            values.append(f"{name}={value}")
    return ", ".join(values)


def refusal(report: ProgramReport, config: RunConfig, target: Any = None) -> str:
    """Why `report`'s program does not fit, naming its biggest consumer and the knobs that
    shrink it with their values in `config`. With `target` (the component's
    `report.ComponentTarget`), also where it was compiled for: the mesh, the topology, its
    slices and chips, and what the config's -1 axis came to (the cause when a config is
    compiled for a smaller slice than it was written for)."""
    name, size = report.biggest()
    knobs = KNOBS[report.component].get(name, "")
    where = f"{report.label} ({report.shape})"
    note = ""
    if target is not None:
        where = f"{where} on {target.placement()}"
        note = target.mesh_note()
        note = f". {note}" if note else ""
    if report.error and not report.out_of_memory:
        return f"{where} failed to compile: {report.error}{note}"
    gpu = GPUS.get(report.chip)
    if gpu is not None:  # a share of the GPU: the process's gpu_memory_fraction
        fraction = f"{report.component}.gpu_memory_fraction"
        knobs = f"{knobs}, {fraction}" if knobs else fraction
        device = (
            f"its share of a {report.chip} GPU ({fraction}={report.hbm_bytes / gpu.hbm_bytes:.3g}"
            f" of {gpu.hbm_bytes / GiB:.1f} GiB)"
        )
    else:
        device = f"a {report.chip} chip"
    head = f"{where} does not fit {device}: " + (
        f"the compiler ran out of {'HBM' if gpu is None else 'memory'} ({report.error})"
        if report.out_of_memory
        else f"{report.total / GiB:.1f} GiB needed per chip, over {FIT_FRACTION:.0%} of "
        f"its {report.hbm_bytes / GiB:.{0 if gpu is None else 1}f} GiB "
        f"({FIT_FRACTION * report.hbm_bytes / GiB:.1f} GiB)"
    )
    now = _current_values(knobs, config)
    return (
        f"{head}; the biggest consumer is {name.replace('_', ' ')} ({size / GiB:.1f} GiB): "
        f"change {knobs}" + (f" (now {now})" if now else "") + note
    )
