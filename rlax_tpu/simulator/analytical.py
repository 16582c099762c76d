"""LlamaRL's step-time model (§7 and App. 11 of the paper; shared/papers/digest-llamarl.md §3):
synchronous co-located training against asynchronous training with separately sized
trainer and generator, each under its own memory constraint, and the optimal trainer
fraction θ** = T_t**/(T_t** + T_g**).

Symbols as in the paper: G0 devices, B0 samples per step, M0 bytes per device, W0 bytes
of one model replica, A_t activation bytes per training sample, K_g KV bytes per
generated sequence, η(b) = τ(b)/b seconds per sample at batch b on one model instance.
The second half (`Table3Row`, `table3_step_s`) prices LlamaRL's Table 3 configurations
with a roofline of H100s, to reproduce the paper's speedups from timings consistent with it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

from rlax_tpu.simulator.model import Distribution


@dataclasses.dataclass(frozen=True)
class StepTimeProblem:
    """One RL step's work and the machine (the paper's Definitions 7.2-7.4)."""

    devices: int  # G0
    batch: int  # B0
    memory_bytes: float  # M0 per device
    weight_bytes: float  # W0
    activation_bytes: float  # A_t per training sample in a microbatch
    kv_bytes: float  # K_g per sequence being generated
    eta_train: Callable[[float], float]  # η_t(b): seconds per sample, microbatch b
    eta_gen: Callable[[float], float]  # η_g(b): seconds per sample, decode concurrency b
    train_batches: Sequence[int] = tuple(2**i for i in range(0, 11))
    gen_batches: Sequence[int] = tuple(2**i for i in range(0, 13))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A configuration and its step time. θ is the trainer's fraction of the devices
    (1 for the co-located synchronous plan, where every device does both)."""

    step_s: float
    theta: float
    m_train: float
    m_gen: float
    b_train: int
    b_gen: int
    trainer_s: float = 0.0  # T_t = m_t·η_t(b_t): device-seconds per sample, training
    generator_s: float = 0.0  # T_g = m_g·η_g(b_g): device-seconds per sample, generation


def synchronous_step_s(p: StepTimeProblem, m: float, b_train: int, b_gen: int) -> float:
    """Eq. (2): T_base = (B0/G0)·m·(η_t(b_t) + η_g(b_g))."""
    return p.batch / p.devices * m * (p.eta_train(b_train) + p.eta_gen(b_gen))


def asynchronous_step_s(
    p: StepTimeProblem, theta: float, m_train: float, m_gen: float, b_train: int, b_gen: int
) -> float:
    """Eq. (3): T = (B0/G0)·max(η_t·m_t/θ, η_g·m_g/(1−θ))."""
    if not 0 < theta < 1:
        return math.inf
    return (
        p.batch
        / p.devices
        * max(p.eta_train(b_train) * m_train / theta, p.eta_gen(b_gen) * m_gen / (1 - theta))
    )


def _sync_memory(p: StepTimeProblem, b_train: int, b_gen: int) -> float:
    """Bytes one co-located instance holds (Eqs. 4 + 5 together): 4W0 + A_t·b_t + W0 + K_g·b_g."""
    return 5 * p.weight_bytes + p.activation_bytes * b_train + p.kv_bytes * b_gen


def _train_memory(p: StepTimeProblem, b: int) -> float:
    return 4 * p.weight_bytes + p.activation_bytes * b  # weights, Adam (2W0), gradients


def _gen_memory(p: StepTimeProblem, b: int) -> float:
    return p.weight_bytes + p.kv_bytes * b


def _m_for(need_bytes: float, p: StepTimeProblem, discrete: bool) -> float:
    """Devices per instance: tight memory (Lemmas 11.1, 11.2), or the smallest power of two
    that holds it when `discrete`."""
    m = need_bytes / p.memory_bytes
    if discrete:
        m = 2 ** math.ceil(math.log2(max(m, 1.0)))
    return m


def synchronous_optimum(p: StepTimeProblem, *, discrete: bool = False) -> Plan:
    """Problem (6): the best co-located synchronous plan."""
    best = None
    for bt in p.train_batches:
        for bg in p.gen_batches:
            m = _m_for(_sync_memory(p, bt, bg), p, discrete)
            if discrete and m > p.devices:
                continue
            step = synchronous_step_s(p, m, bt, bg)
            if best is None or step < best.step_s:
                best = Plan(step, 1.0, m, m, bt, bg, m * p.eta_train(bt), m * p.eta_gen(bg))
    if best is None:
        raise ValueError("no synchronous plan fits in memory")
    return best


def _best_side(p: StepTimeProblem, batches, memory, eta, discrete) -> tuple[float, float, int]:
    """min over b of m(b)·η(b) (Eq. 10): (T, m, b)."""
    best = None
    for b in batches:
        m = _m_for(memory(p, b), p, discrete)
        if discrete and m > p.devices:
            continue
        cost = m * eta(b)
        if best is None or cost < best[0]:
            best = (cost, m, b)
    if best is None:
        raise ValueError("no plan fits in memory")
    return best


def asynchronous_optimum(p: StepTimeProblem, *, discrete: bool = False) -> Plan:
    """Problem (7): separately sized trainer and generator. Continuous: T_t**, T_g** of
    Eq. (10), θ** = T_t**/(T_t** + T_g**) balancing Eq. (16), step (B0/G0)(T_t** + T_g**).
    Discrete: powers of two for m, θ·G0 a multiple of m_t and (1−θ)·G0 of m_g."""
    tt, mt, bt = _best_side(p, p.train_batches, _train_memory, p.eta_train, discrete)
    tg, mg, bg = _best_side(p, p.gen_batches, _gen_memory, p.eta_gen, discrete)
    if not discrete:
        theta = tt / (tt + tg)
        return Plan(p.batch / p.devices * (tt + tg), theta, mt, mg, bt, bg, tt, tg)
    best = None
    for trainer_devices in range(int(mt), p.devices, int(mt)):
        if (p.devices - trainer_devices) % int(mg):
            continue
        theta = trainer_devices / p.devices
        step = asynchronous_step_s(p, theta, mt, mg, bt, bg)
        if best is None or step < best.step_s:
            best = Plan(step, theta, mt, mg, bt, bg, tt, tg)
    if best is None:
        raise ValueError("no asynchronous split of the devices fits both instance sizes")
    return best


def disaggregated_synchronous_step_s(p: StepTimeProblem) -> float:
    """[ext] Separate devices but no overlap: (B0/G0)·(T_t/θ + T_g/(1−θ)), minimised at
    θ = √T_t/(√T_t + √T_g): (B0/G0)·(√T_t + √T_g)²."""
    tt = _best_side(p, p.train_batches, _train_memory, p.eta_train, False)[0]
    tg = _best_side(p, p.gen_batches, _gen_memory, p.eta_gen, False)[0]
    return p.batch / p.devices * (math.sqrt(tt) + math.sqrt(tg)) ** 2


# -- LlamaRL Table 3 by a roofline ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Accelerator:
    """An H100 SXM (bf16 dense, fp8 dense, HBM3) unless told otherwise."""

    flops: float = 989e12
    fp8_flops: float = 1979e12
    hbm_bytes_per_s: float = 3.35e12
    memory_bytes: float = 80e9
    train_mfu: float = 0.35
    decode_bandwidth_efficiency: float = 0.7
    decode_flops_efficiency: float = 0.5
    # Tensor-parallel all-reduces, two per layer per decode step: within a node of
    # `node_devices` (NVSwitch) each takes `allreduce_s`; across nodes a ring adds
    # `allreduce_hop_s` per device beyond the node (InfiniBand hops).
    allreduce_s: float = 80e-6
    allreduce_hop_s: float = 8e-6
    node_devices: int = 8

    def allreduce_time_s(self, m: int) -> float:
        if m <= 1:
            return 0.0
        return self.allreduce_s + self.allreduce_hop_s * max(0, m - self.node_devices)


@dataclasses.dataclass(frozen=True)
class LlamaModel:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int = 8
    head_dim: int = 128


LLAMA_3_1 = {
    "8B": LlamaModel("8B", 8.0e9, 32, 4096),
    "70B": LlamaModel("70B", 70.6e9, 80, 8192),
    "405B": LlamaModel("405B", 405.9e9, 126, 16384),
}


@dataclasses.dataclass(frozen=True)
class Table3Row:
    """A row of LlamaRL's Table 3: devices, model parallelism and per-group decode
    concurrency (the paper's "c × DP"), the measured step time."""

    model: str
    system: str  # "baseline" (synchronous, co-located) or "llamarl"
    devices: int
    gen_devices: int
    train_devices: int
    m_gen: int
    concurrency: int
    fp8: bool
    paper_step_s: float


TABLE3 = (
    Table3Row("8B", "baseline", 256, 256, 256, 8, 16, False, 22.45),
    Table3Row("8B", "llamarl", 256, 128, 128, 8, 64, False, 12.22),
    Table3Row("8B", "llamarl", 256, 128, 128, 1, 32, False, 8.90),
    Table3Row("70B", "baseline", 256, 256, 256, 8, 16, False, 82.32),
    Table3Row("70B", "llamarl", 256, 128, 128, 8, 64, False, 26.19),
    # The paper lists 120 generator / 136 trainer GPUs, but 34 groups × mp 4 = 136 GPUs
    # generate (digest §4): the columns are swapped.
    Table3Row("70B", "llamarl", 256, 136, 120, 4, 16, True, 20.67),
    Table3Row("405B", "baseline", 1024, 1024, 1024, 64, 32, False, 635.8),
    Table3Row("405B", "llamarl", 1024, 512, 512, 32, 32, False, 240.8),
    Table3Row("405B", "llamarl", 1024, 512, 512, 16, 48, False, 100.5),
    Table3Row("405B", "llamarl", 1024, 512, 512, 8, 32, True, 59.5),
)


@dataclasses.dataclass(frozen=True)
class Table3Workload:
    """What the paper does not say, assumed: prompt and response lengths (MATH-like, a
    2048-token generation budget, heavy-tailed) and the samples of a step (512 prompts × 4
    = 2048, as the paper)."""

    batch: int = 2048
    prompt_tokens: int = 256
    response: Distribution = Distribution(
        kind="lognormal", median=1000.0, sigma=1.0, minimum=16, maximum=2048
    )


def _decode_step_s(model: LlamaModel, hw: Accelerator, m: int, slots: int, ctx: float, fp8: bool):
    """One decode step of `slots` sequences on an instance of `m` devices: the slower of
    reading weights + KV and the FLOPs, plus the tensor-parallel all-reduces."""
    weight_bytes = model.params * (1 if fp8 else 2)
    kv = slots * ctx * 2 * model.layers * model.kv_heads * model.head_dim * 2  # bf16 KV
    memory_s = (weight_bytes + kv) / (m * hw.hbm_bytes_per_s * hw.decode_bandwidth_efficiency)
    peak = hw.fp8_flops if fp8 else hw.flops
    compute_s = slots * 2 * model.params / (m * peak * hw.decode_flops_efficiency)
    return max(memory_s, compute_s) + 2 * model.layers * hw.allreduce_time_s(m)


def _continuous_batching_steps(lengths: Sequence[int], slots: int) -> int:
    """Decode steps until every sequence is done, each slot refilled as it frees."""
    free = [0] * max(1, slots)
    for tokens in lengths:
        heapq.heappush(free, heapq.heappop(free) + tokens)
    return max(free)


def table3_step_s(
    row: Table3Row,
    workload: Table3Workload = Table3Workload(),
    hw: Accelerator = Accelerator(),
) -> dict[str, float]:
    """Eq. (2) (baseline) or Eq. (3) (LlamaRL) for one Table 3 row, with τ_g from the
    roofline decode step and straggler-aware continuous batching, τ_t from the trainer's
    FLOPs at `hw.train_mfu`. Returns the step and its generation and training parts."""
    model = LLAMA_3_1[row.model]
    groups = row.gen_devices // row.m_gen
    n = math.ceil(workload.batch / groups)  # sequences per generator group
    # Deterministic response lengths (the distribution's quantiles, interleaved), decoded
    # by continuous batching over the group's slots: the step waits for the longest slot.
    lengths = [math.ceil(workload.response.quantile(((i * 7919) % n + 0.5) / n)) for i in range(n)]
    slots = min(row.concurrency, n)
    ctx = workload.prompt_tokens + workload.response.mean() / 2
    step = _decode_step_s(model, hw, row.m_gen, slots, ctx, row.fp8)
    peak = hw.fp8_flops if row.fp8 else hw.flops
    prefill = 2 * model.params * workload.prompt_tokens / (row.m_gen * peak * 0.5)
    gen_s = _continuous_batching_steps(lengths, slots) * step + n * prefill
    tokens = workload.batch * (workload.prompt_tokens + workload.response.mean())
    train_s = 6 * model.params * tokens / (row.train_devices * hw.flops * hw.train_mfu)
    total = gen_s + train_s if row.system == "baseline" else max(gen_s, train_s)
    return {"step_s": total, "generation_s": gen_s, "train_s": train_s}


def reproduce_table3(
    workload: Table3Workload = Table3Workload(), hw: Accelerator = Accelerator()
) -> list[dict[str, object]]:
    """Every Table 3 row: the model's step time and speedup over its baseline, next to the
    paper's."""
    baseline: dict[str, tuple[float, float]] = {}
    out = []
    for row in TABLE3:
        figures = table3_step_s(row, workload, hw)
        if row.system == "baseline":
            baseline[row.model] = (figures["step_s"], row.paper_step_s)
        model_base, paper_base = baseline[row.model]
        out.append(
            {
                "model": row.model,
                "system": row.system,
                "gpus": f"{row.devices} ({row.gen_devices} gen / {row.train_devices} train)"
                if row.system == "llamarl"
                else str(row.devices),
                "m_gen": row.m_gen,
                "concurrency": row.concurrency,
                "fp8": row.fp8,
                "step_s": figures["step_s"],
                "generation_s": figures["generation_s"],
                "train_s": figures["train_s"],
                "speedup": model_base / figures["step_s"],
                "paper_step_s": row.paper_step_s,
                "paper_speedup": paper_base / row.paper_step_s,
            }
        )
    return out
