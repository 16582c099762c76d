"""The simulator's model of a run: what the run does (`Workload`, from a RunConfig) and how
long each piece of work takes (`TimingModel`), calibrated from the project's benchmark
JSONs, from the figures of hardware we cannot measure here (`HardwareSpec`), from
`rlax-tpu compile` reports (`compiled.py`) and from explicit settings, in that order.

Pure Python, no JAX: sizing a pod run must not need the accelerator stack. Units are in
the names (`_s`, `_bytes`, `_per_s`); every time is wall-clock seconds on the device the
calibration describes.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu.compile.hardware import STATED_EFFICIENCY
from rlax_tpu.config import ConfigBase, ConfigError, Distribution, ModelConfig, RunConfig
from rlax_tpu.config.base import require
from rlax_tpu.shapes import padded_seq_len
from rlax_tpu.simulator import workloads as bench_workload
from rlax_tpu.staleness import StalenessPolicy

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class CalibrationError(ValueError):
    """A calibration file cannot be read or does not say what it must; the message names it."""


# -- model arithmetic ----------------------------------------------------------------------------
def count_params(model: ModelConfig) -> int:
    """Parameters of `rlax_tpu.models.Transformer` for `model` (the same tree, counted)."""
    c = model
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    if c.qkv_bias:
        attn += c.head_dim * (c.num_heads + 2 * c.num_kv_heads)
    if c.qk_norm:
        attn += 2 * c.head_dim
    layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    total = c.num_layers * layer + c.vocab_size * c.hidden_size + c.hidden_size
    if not c.tie_word_embeddings:
        total += c.hidden_size * c.vocab_size
    if c.value_head:
        total += c.hidden_size + 1
    return total


def count_arrays(model: ModelConfig) -> int:
    """Arrays in the params tree of `rlax_tpu.models.Transformer` for `model`: what a publish
    and a pull pay a fixed cost for each of (rlax_tpu.param_server sends array by array)."""
    c = model
    layer = 9 + (3 if c.qkv_bias else 0) + (2 if c.qk_norm else 0)  # q k v o, 3 mlp, 2 norms
    total = c.num_layers * layer + 2  # embedding, final norm
    if not c.tie_word_embeddings:
        total += 1
    if c.value_head:
        total += 2
    return total


def model_bytes(model: ModelConfig) -> int:
    """Bytes of one published version (the parameters in the published dtype,
    `model.publish_dtype`, "" = param_dtype): what a publish and a pull move."""
    return count_params(model) * DTYPE_BYTES[model.published_dtype]


def decode_flops_per_token(model: ModelConfig, context: float) -> float:
    """Matmul FLOPs of one decoded token at `context` tokens of context: 2 × the weights a
    token uses (the embedding is a gather) plus attention (q·k and p·v). tools/bench_inference.py
    reports its rates with this count, so they transfer."""
    c = model
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    weights = c.num_layers * (attn + mlp) + c.hidden_size * c.vocab_size
    return 2.0 * weights + 4.0 * c.num_layers * c.num_heads * c.head_dim * context


def train_flops_per_token(model: ModelConfig, seq_len: float) -> float:
    """Forward + backward FLOPs per trained token: 6·N (the trainer's MFU count) plus causal
    attention, 6·layers·heads·head_dim·seq (negligible for short sequences)."""
    c = model
    return 6.0 * count_params(model) + 6.0 * c.num_layers * c.num_heads * c.head_dim * seq_len


# -- the timing model -----------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True, frozen=True)
class TimingModel(ConfigBase):
    """How long each piece of work takes. Defaults are this project's 2-core CPU demo scale
    (uncalibrated guesses); `calibrate` replaces them with measured or given figures."""

    # Generation, per inference worker: continuous batching over `decode_slots` slots (the
    # config's inference.max_decode_slots). A decode step is costed as one of every slot
    # (the engine's largest decode bucket: an upper bound, since it runs only the live
    # slots padded to a bucket, and the simulator does not model KV-page pressure),
    # `decode_steps_per_call` steps per device call (a rollout worker's engine runs 1).
    # Waiting prompts are admitted into free slots in rounds; a round prefills them
    # inference.prefill_batch_size rows per call (padded rows compute too), per bucket.
    decode_step_s: float = 0.002
    decode_call_s: float = 0.002
    decode_steps_per_call: int = 1
    prefill_call_s: float = 0.002
    prefill_s_per_token: float = 2e-5
    # One Generate call beyond the engine's work: the RPC, the worker's hand-offs, the
    # rollouts' conversion and streaming back (bench_inference's `served_generate`).
    job_overhead_s: float = 0.002
    rollout_overhead_s: float = 0.0  # per rollout: streaming it back to the controller
    worker_compile_s: float = 0.0  # the first generation of a (re)started worker
    # Trainer: one train step on `tokens` tokens = train_fixed_s + tokens·train_s_per_token,
    # plus train_overhead_s around the jitted step (batch placement, bookkeeping) and, every
    # trainer.checkpoint_every steps, checkpoint_s to start the async checkpoint. Every new
    # padded sequence length (rlax_tpu.shapes) compiles the step: trainer_compile_s.
    train_fixed_s: float = 0.05
    train_s_per_token: float = 1e-4
    train_overhead_s: float = 0.0
    checkpoint_s: float = 0.0
    trainer_compile_s: float = 0.0
    # Weights: a publish (inside the train step) and a worker's load of a version, through
    # the parameter server. Each costs a fixed latency per version plus one per array, then
    # its bytes: concurrent pulls share `ps_bytes_per_s` (0 = unlimited), each is also capped
    # by its own link, the first pull of a version reads it from storage. A load ends with
    # the swap of the pulled arrays into the engine (placement on the worker's devices).
    publish_fixed_s: float = 0.005
    publish_s_per_array: float = 0.0
    publish_bytes_per_s: float = 2e8
    pull_fixed_s: float = 0.005
    pull_s_per_array: float = 0.0
    pull_bytes_per_s: float = 1e9
    first_pull_bytes_per_s: float = 3e8
    ps_bytes_per_s: float = 0.0
    pull_fraction: float = 1.0  # of the version's bytes a worker pulls (1 = a full replica)
    swap_fixed_s: float = 0.0
    swap_s_per_array: float = 0.0
    # Verifier service: per batch one call; requests run on a pool of workers with a
    # lognormal service time (p50, p95). 0 workers = the config's verifiers.num_workers.
    verify_call_s: float = 0.005
    verify_p50_s: float = 0.0005
    verify_p95_s: float = 0.001
    verifier_workers: int = 0
    # Controller: assembling a batch, metrics, consumed records (per step); snapshot writes.
    controller_step_s: float = 0.02
    snapshot_s: float = 0.005
    # Components sharing one machine (the CPU demo): its cores, each component's demand
    # while it computes, and the fraction of the cores left when they are oversubscribed.
    # 0 host cores: every component has its own hardware (a pod).
    host_cores: float = 0.0
    trainer_cores: float = 1.0
    worker_cores: float = 1.0
    verifier_cores: float = 0.5
    controller_cores: float = 0.5
    io_cores: float = 1.0  # publishes, pulls' fixed costs, swaps, checkpoint starts (host work)
    contention_efficiency: float = 1.0

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            require(value >= 0, f.name, f"must be >= 0, got {value}")
        for name in ("publish_bytes_per_s", "pull_bytes_per_s", "first_pull_bytes_per_s"):
            require(getattr(self, name) > 0, name, "must be > 0")
        require(self.decode_steps_per_call >= 1, "decode_steps_per_call", "must be >= 1")
        require(self.verify_p95_s >= self.verify_p50_s, "verify_p95_s", "must be >= verify_p50_s")
        require(0 < self.pull_fraction <= 1, "pull_fraction", "must be in (0, 1]")
        require(0 < self.contention_efficiency <= 1, "contention_efficiency", "must be in (0, 1]")


@dataclasses.dataclass(kw_only=True, frozen=True)
class PreemptionConfig(ConfigBase):
    """Preemptions of the whole job (any component's death stops the run; it resumes).

    A hard preemption loses everything since the newest snapshot's trainer checkpoint (the
    newest multiple of trainer.checkpoint_every at or below the newest reload boundary);
    with `notice` (SIGTERM ahead of the kill, as GKE and TPU VMs give) the final snapshot
    checkpoints the step reached. With `reuse_rollout_log` the rollouts already logged for
    the batches to redo are reused when their version is the one asked again (always, under
    the deterministic schedule); otherwise they are discarded and regenerated.
    """

    per_hour: float = 0.0
    restart_s: float = 300.0
    notice: bool = False
    reuse_rollout_log: bool = True

    def validate(self) -> None:
        require(self.per_hour >= 0, "per_hour", "must be >= 0")
        require(self.restart_s >= 0, "restart_s", "must be >= 0")


@dataclasses.dataclass(kw_only=True, frozen=True)
class HardwareSpec(ConfigBase):
    """Figures of accelerators we cannot measure here (e.g. TPU v5p from its data sheet and
    your own profiles); `calibrate` turns them into a TimingModel by a roofline: decode is
    the slower of reading the weights + KV cache and its FLOPs, training and prefill run at
    the given utilisation."""

    name: str = ""
    peak_flops_per_chip: float = 0.0  # in the compute dtype (bf16)
    hbm_bytes_per_s_per_chip: float = 0.0
    memory_bytes_per_chip: float = 95e9  # M0 of LlamaRL's model (HBM per chip)
    trainer_chips: int = 0
    chips_per_worker: int = 0
    train_mfu: float = 0.4
    prefill_mfu: float = 0.5
    decode_flops_efficiency: float = 0.5
    decode_bandwidth_efficiency: float = 0.6
    serve_dtype_bytes: float = 2.0  # bytes per weight and KV element when serving (1 = fp8)
    decode_call_s: float = 0.0  # host round trip per decode call
    prefill_call_s: float = 0.0
    # The fraction of a compiled program's roofline (an `rlax-tpu compile --json` report:
    # max(FLOPs/peak, HBM bytes/bandwidth), a lower bound) the run reaches. The defaults are
    # the guesses above for the same work, so a compile report changes what is counted
    # (the compiled programs' own FLOPs and bytes), not how efficient it is assumed to be.
    compiled_train_efficiency: float = STATED_EFFICIENCY["train"]
    compiled_prefill_efficiency: float = STATED_EFFICIENCY["prefill"]
    compiled_decode_efficiency: float = STATED_EFFICIENCY["decode"]

    def validate(self) -> None:
        for name in (
            "train_mfu",
            "prefill_mfu",
            "decode_flops_efficiency",
            "compiled_train_efficiency",
            "compiled_prefill_efficiency",
            "compiled_decode_efficiency",
        ):
            require(0 < getattr(self, name) <= 1, name, "must be in (0, 1]")
        require(
            0 < self.decode_bandwidth_efficiency <= 1, "decode_bandwidth_efficiency", "in (0, 1]"
        )
        require(self.serve_dtype_bytes > 0, "serve_dtype_bytes", "must be > 0")

    @property
    def given(self) -> bool:
        return self.peak_flops_per_chip > 0 and self.hbm_bytes_per_s_per_chip > 0


@dataclasses.dataclass(kw_only=True, frozen=True)
class SimulatorConfig(ConfigBase):
    """What the simulator needs beyond the RunConfig: the length distributions of the task
    (default: the config's expected ones), the timing model, hardware figures and
    preemptions."""

    # None: the config's inference.response_tokens / prompt_tokens (whose own defaults are
    # lognormal with median max_new_tokens/4, σ = 1, and fixed at half of max_prompt_len).
    response_tokens: Distribution | None = None
    prompt_tokens: Distribution | None = None
    timing: TimingModel = TimingModel()
    hardware: HardwareSpec = HardwareSpec()
    preemption: PreemptionConfig = PreemptionConfig()
    evaluations: bool = True  # simulate the controller's held-out evaluations
    seed: int = 0


# -- the workload -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """The shape of a run as the controller drives it (from a RunConfig)."""

    num_steps: int
    prompts_per_batch: int
    samples_per_prompt: int
    num_workers: int
    decode_slots: int
    prefill_buckets: tuple[int, ...]
    prefill_rows: int
    max_new_tokens: int
    max_seq_len: int
    policy: StalenessPolicy
    checkpoint_every: int
    eval_every: int
    eval_size: int
    evaluations: bool
    model: ModelConfig
    verifier_workers: int
    response_tokens: Distribution
    prompt_tokens: Distribution
    uses_code_verifier: bool = False

    @classmethod
    def from_config(cls, config: RunConfig, sim: SimulatorConfig | None = None) -> Workload:
        sim = sim or SimulatorConfig()
        inf, ctl = config.inference, config.controller
        # The simulator config's lengths, else the run config's expected ones (clipped alike).
        expected = dataclasses.replace(
            inf,
            prompt_tokens=sim.prompt_tokens or inf.prompt_tokens,
            response_tokens=sim.response_tokens or inf.response_tokens,
        )
        prompt, response = expected.length_distributions()
        return cls(
            num_steps=ctl.num_steps,
            prompts_per_batch=ctl.prompts_per_batch,
            samples_per_prompt=ctl.samples_per_prompt,
            num_workers=inf.num_workers,
            decode_slots=inf.max_decode_slots,
            prefill_buckets=tuple(inf.prefill_buckets),
            prefill_rows=inf.prefill_rows,
            max_new_tokens=inf.max_new_tokens,
            max_seq_len=config.trainer.max_seq_len,
            policy=StalenessPolicy.from_config(config.staleness),
            checkpoint_every=config.trainer.checkpoint_every,
            eval_every=ctl.eval_every,
            eval_size=ctl.eval_size,
            evaluations=sim.evaluations and bool(ctl.eval_dataset),
            model=config.model,
            verifier_workers=sim.timing.verifier_workers or config.verifiers.num_workers,
            response_tokens=response,
            prompt_tokens=prompt,
            uses_code_verifier=any(d.verifier == "code" for d in config.training_datasets),
        )

    @property
    def batch_size(self) -> int:
        return self.prompts_per_batch * self.samples_per_prompt

    @property
    def model_bytes(self) -> int:
        return model_bytes(self.model)

    @property
    def model_arrays(self) -> int:
        return count_arrays(self.model)

    def bucket(self, prompt_tokens: int) -> int:
        return next((b for b in self.prefill_buckets if b >= prompt_tokens), prompt_tokens)

    def mean_context(self) -> float:
        """Mean context of a decoded token: the prompt plus half the response."""
        return self.prompt_tokens.mean() + self.response_tokens.mean() / 2


# -- the work's durations -------------------------------------------------------------------------
def generation_s(
    timing: TimingModel,
    workload: Workload,
    prompt_tokens: Sequence[int],
    response_tokens: Sequence[int],
) -> float:
    """One Generate call of these requests on one worker (already loaded and compiled).

    Continuous batching as the engine does it: requests are admitted first in, first out,
    into free slots; each admission round prefills what it admitted in calls of
    `workload.prefill_rows` rows per prompt bucket (a call costs its padded rows × bucket
    tokens, whatever the rows hold); a request's first token comes from its prefill, then
    it holds a slot for ceil((tokens - 1)/k) decode calls (a request that ends at its first
    token frees its slot in the same round). The call lasts until its longest slot is
    done, so a heavy-tailed length leaves a straggler.
    """
    t, k, rows = timing, timing.decode_steps_per_call, max(1, workload.prefill_rows)
    free_at = [0] * min(workload.decode_slots, max(1, len(response_tokens)))  # in calls
    heapq.heapify(free_at)
    admitted: dict[tuple[int, int], int] = {}  # (round = decode call index, bucket) -> prompts
    end = 0
    for prompt, tokens in zip(prompt_tokens, response_tokens, strict=True):
        calls = math.ceil(max(0, tokens - 1) / k)
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + calls)
        key = (start, workload.bucket(prompt))
        admitted[key] = admitted.get(key, 0) + 1
        end = max(end, start + calls)
    prefill = sum(
        math.ceil(n / rows) * (t.prefill_call_s + rows * bucket * t.prefill_s_per_token)
        for (_, bucket), n in admitted.items()
    )
    decode = end * (t.decode_call_s + k * t.decode_step_s)
    return t.job_overhead_s + prefill + decode + len(response_tokens) * t.rollout_overhead_s


def train_seq_len(workload: Workload, prompt_tokens, response_tokens) -> int:
    """The padded sequence length of a training batch (the controller's padding,
    rlax_tpu.shapes.padded_seq_len of its longest prompt + response): one compiled shape."""
    longest = max(p + r for p, r in zip(prompt_tokens, response_tokens, strict=True))
    return padded_seq_len(longest, workload.max_seq_len)


def train_s(timing: TimingModel, workload: Workload, prompt_tokens, response_tokens) -> float:
    """One train step (without the publish): rows padded as the controller pads them
    (rlax_tpu.shapes.padded_seq_len of the batch's longest prompt + response)."""
    seq = train_seq_len(workload, prompt_tokens, response_tokens)
    return timing.train_fixed_s + len(response_tokens) * seq * timing.train_s_per_token


def publish_s(timing: TimingModel, workload: Workload) -> float:
    """The trainer's publish of a version: per version, per array, then its bytes."""
    t = timing
    return (
        t.publish_fixed_s
        + workload.model_arrays * t.publish_s_per_array
        + workload.model_bytes / t.publish_bytes_per_s
    )


def pull_latency_s(timing: TimingModel, workload: Workload) -> float:
    """A worker's pull of a version before its bytes flow: per version and per array."""
    return timing.pull_fixed_s + workload.model_arrays * timing.pull_s_per_array


def swap_s(timing: TimingModel, workload: Workload) -> float:
    """A worker's swap of pulled weights into its engine."""
    return timing.swap_fixed_s + workload.model_arrays * timing.swap_s_per_array


def verify_s(timing: TimingModel, workers: int, n: int, rng: random.Random) -> float:
    """A batch of `n` verifications: one call, requests spread over the pool's workers."""
    if n == 0:
        return 0.0
    service = Distribution.from_p50_p95(timing.verify_p50_s, timing.verify_p95_s)
    free = [0.0] * max(1, min(workers, n))
    for _ in range(n):
        heapq.heappush(free, heapq.heappop(free) + service.sample(rng))
    return timing.verify_call_s + max(free)


# -- calibration ----------------------------------------------------------------------------------
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
        from rlax_tpu.simulator.compiled import from_compile_report  # imports this module

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
