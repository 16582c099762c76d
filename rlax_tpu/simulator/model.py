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
import itertools
import math
import random
from collections.abc import Hashable, Sequence

from rlax_tpu.config import ConfigBase, Distribution, ModelConfig, RunConfig
from rlax_tpu.config.base import require
from rlax_tpu.hardware import STATED_EFFICIENCY
from rlax_tpu.shapes import first_fit, padded_seq_len, shared_prompt_units, shared_unit_size
from rlax_tpu.staleness import InFlightPlan, StalenessPolicy

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
    return total + lora_params(model)


def _lora_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(in features, out features) of each projection one decoder layer adapts."""
    c = model
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    dims = {
        "q_proj": (c.hidden_size, q),
        "k_proj": (c.hidden_size, kv),
        "v_proj": (c.hidden_size, kv),
        "o_proj": (q, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }
    return [dims[t] for t in model.lora.targets] if model.lora is not None else []


def lora_params(model: ModelConfig) -> int:
    """Parameters of the LoRA adapters (model.lora; 0 without): r·(in + out) per adapted
    projection and layer."""
    r = model.lora.rank if model.lora is not None else 0
    return model.num_layers * sum(r * (i + o) for i, o in _lora_shapes(model))


def count_arrays(model: ModelConfig) -> int:
    """Arrays of one published version of `model`: what a publish and a pull pay a fixed
    cost for each of (rlax_tpu.param_server sends array by array). The params tree of
    `rlax_tpu.models.Transformer`, or with LoRA its adapters packed in one array and the
    base's digest."""
    c = model
    if c.lora is not None:
        return 2  # the packed adapters (models.lora.pack) and the base's digest
    layer = 9 + (3 if c.qkv_bias else 0) + (2 if c.qk_norm else 0)  # q k v o, 3 mlp, 2 norms
    total = c.num_layers * layer + 2  # embedding, final norm
    if not c.tie_word_embeddings:
        total += 1
    if c.value_head:
        total += 2
    return total


def model_bytes(model: ModelConfig) -> int:
    """Bytes of one published version (the parameters in the published dtype,
    `model.publish_dtype`, "" = param_dtype; with LoRA the adapters and the base's 32-byte
    digest): what a publish and a pull move."""
    if model.lora is not None:
        return lora_params(model) * DTYPE_BYTES[model.published_dtype] + 32
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
    attention, 6·layers·heads·head_dim·seq (negligible for short sequences). With LoRA the
    frozen base needs no weight gradients: 4·N + 6·(adapter parameters) (`train_flops`)."""
    c = model
    attention = 6.0 * c.num_layers * c.num_heads * c.head_dim * seq_len
    trained = lora_params(model) if model.lora is not None else count_params(model)
    return 4.0 * count_params(model) + 2.0 * trained + attention


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
    # inference.prefill_batch_size rows per call (padded rows compute too), per bucket;
    # with inference.share_prompt_pages the samples of one prompt admitted in a round
    # take one row between them.
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
    # inference.in_flight_update = "keep": a paused request's KV pages are copied to host
    # memory at its pause and back at its continuation, whole sequences of pages (padded to
    # the power of two the swap copies compile at), each way at this rate. A guess (a
    # host-device copy, about PCIe 4 x16): nothing here measures it yet.
    kv_swap_bytes_per_s: float = 1e10
    # Trainer: one train step on `tokens` tokens = train_fixed_s + tokens·train_s_per_token
    # (`train_tokens`: the padded rows, or with trainer.tokens_per_row the packed rows the
    # step runs), plus train_overhead_s around the jitted step (batch placement,
    # bookkeeping) and, every trainer.checkpoint_every steps, checkpoint_s to start the
    # async checkpoint. Every new padded sequence length (rlax_tpu.shapes) compiles the
    # step, packed or not: trainer_compile_s.
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
        for name in (
            "publish_bytes_per_s",
            "pull_bytes_per_s",
            "first_pull_bytes_per_s",
            "kv_swap_bytes_per_s",
        ):
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
    # The samples of one prompt admitted in a round share its prefill row and its full KV
    # pages (inference.share_prompt_pages).
    share_prompt_pages: bool
    max_new_tokens: int
    max_seq_len: int
    mini_batch_size: int  # sequences per optimizer update (trainer.mini_batch_size)
    micro_batch_size: int  # rows per forward/backward pass (trainer.micro_batch_size)
    tokens_per_row: int  # packed rows of this many tokens; 0 = padded rows (trainer's)
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
    page_size: int = 16  # tokens per KV page (what a "keep" continuation swaps in)
    in_flight: InFlightPlan | None = None  # the ticks of in-flight updates (None: "off")
    # Packed rows hold a group's prompt once (trainer.share_prefixes with tokens_per_row).
    share_prefixes: bool = False

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
        policy = StalenessPolicy.from_config(config.staleness)
        return cls(
            num_steps=ctl.num_steps,
            prompts_per_batch=ctl.prompts_per_batch,
            samples_per_prompt=ctl.samples_per_prompt,
            num_workers=inf.num_workers,
            decode_slots=inf.max_decode_slots,
            prefill_buckets=tuple(inf.prefill_buckets),
            prefill_rows=inf.prefill_rows,
            share_prompt_pages=inf.share_prompt_pages,
            max_new_tokens=inf.max_new_tokens,
            max_seq_len=config.trainer.max_seq_len,
            mini_batch_size=config.trainer.mini_batch_size,
            micro_batch_size=config.trainer.micro_batch_size,
            tokens_per_row=config.trainer.tokens_per_row,
            share_prefixes=config.trainer.share_prefixes and config.trainer.tokens_per_row > 0,
            policy=policy,
            checkpoint_every=config.trainer.checkpoint_every,
            eval_every=ctl.eval_every,
            eval_size=ctl.eval_size,
            evaluations=sim.evaluations and bool(ctl.eval_dataset),
            model=config.model,
            verifier_workers=sim.timing.verifier_workers or config.verifiers.num_workers,
            response_tokens=response,
            prompt_tokens=prompt,
            uses_code_verifier=any(d.verifier == "code" for d in config.training_datasets),
            page_size=inf.page_size,
            in_flight=InFlightPlan.of(config, policy),
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

    def continuation_bucket(self, tokens: int) -> int:
        """The prefill length of a "resume" continuation of `tokens` (prompt + tokens so far):
        a prefill bucket that holds it, else the power of two above the largest, at most
        max_seq_len."""
        if tokens <= max(self.prefill_buckets, default=0):
            return self.bucket(tokens)
        return min(1 << (tokens - 1).bit_length(), max(self.max_seq_len, tokens))

    def new_tokens(self, batch: int, response_tokens: int, done_tokens: int) -> int:
        """The tokens a request of `batch` with `response_tokens` in all and `done_tokens` so
        far generates in its next call: all that are left, or with in-flight updates at most
        the tick's budget (InFlightPlan.budget; it pauses there)."""
        left = response_tokens - done_tokens
        budget = self.in_flight.budget(batch, done_tokens) if self.in_flight else 0
        return min(left, budget) if budget else left

    def mean_context(self) -> float:
        """Mean context of a decoded token: the prompt plus half the response."""
        return self.prompt_tokens.mean() + self.response_tokens.mean() / 2


# -- the work's durations -------------------------------------------------------------------------
def generation_s(
    timing: TimingModel,
    workload: Workload,
    prompt_tokens: Sequence[int],
    response_tokens: Sequence[int],
    done_tokens: Sequence[int] = (),
    groups: Sequence[Hashable] = (),
) -> float:
    """One Generate call of these requests on one worker (already loaded and compiled).

    Continuous batching as the engine does it: requests are admitted first in, first out,
    into free slots; each admission round prefills what it admitted in calls of
    `workload.prefill_rows` rows per prompt bucket (a call costs its padded rows × bucket
    tokens, whatever the rows hold); a request's first token comes from its prefill, then
    it holds a slot for ceil((tokens - 1)/k) decode calls (a request that ends at its first
    token frees its slot in the same round). The call lasts until its longest slot is
    done, so a heavy-tailed length leaves a straggler.

    `groups`: a key per request, equal for the samples of one prompt (none: every request
    a prompt of its own). With `workload.share_prompt_pages` the new requests of a group
    admitted in the same round take one prefill row between them, as the engine's
    scheduler prefills a prompt once for the samples admitted with it (a sample admitted
    in a later round, when slots free up one by one, is prefilled again). Their shared KV
    pages cost no time here: the simulator does not model the page pool, and each sample's
    decode still reads its whole context.

    With in-flight updates a request may continue one paused in an earlier tick:
    `done_tokens` are its tokens so far (none or 0: a new request) and `response_tokens`
    the new ones of this call. "resume" prefills prompt + tokens so far at its
    continuation bucket, then decodes as a new request does; "keep" swaps its parked KV
    pages back in (`kv_swap_s`, both ways) and decodes every new token (the token sampled
    last before the pause has no KV yet).
    """
    t, k, rows = timing, timing.decode_steps_per_call, max(1, workload.prefill_rows)
    done_tokens = done_tokens or [0] * len(response_tokens)
    keep = workload.in_flight is not None and workload.in_flight.mode == "keep"
    free_at = [0] * min(workload.decode_slots, max(1, len(response_tokens)))  # in calls
    heapq.heapify(free_at)
    # A prefill row per prompt: its group's when the samples of a prompt share one.
    prompts = groups if workload.share_prompt_pages and groups else range(len(response_tokens))
    # (round = decode call index, bucket) -> the prompts it prefills (a row each)
    admitted: dict[tuple[int, int], set[Hashable]] = {}
    end, swap = 0, 0.0
    for i, (prompt, tokens, done) in enumerate(
        zip(prompt_tokens, response_tokens, done_tokens, strict=True)
    ):
        kept = keep and done > 0
        calls = math.ceil((tokens if kept else max(0, tokens - 1)) / k)
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + calls)
        if kept:
            swap += kv_swap_s(timing, workload, prompt + done)
        else:
            bucket = (
                workload.continuation_bucket(prompt + done) if done else workload.bucket(prompt)
            )
            # A continuation's context is its own (prompt and tokens so far): its own row.
            row = prompts[i] if not done else ("continuation", i)
            admitted.setdefault((start, bucket), set()).add(row)
        end = max(end, start + calls)
    prefill = sum(
        math.ceil(len(round_rows) / rows)
        * (t.prefill_call_s + rows * bucket * t.prefill_s_per_token)
        for (_, bucket), round_rows in admitted.items()
    )
    decode = end * (t.decode_call_s + k * t.decode_step_s)
    return t.job_overhead_s + prefill + swap + decode + len(response_tokens) * t.rollout_overhead_s


def kv_swap_s(timing: TimingModel, workload: Workload, tokens: int) -> float:
    """A "keep" continuation's KV pages of `tokens` (prompt + tokens so far): out to host
    memory at its pause and back in now, in whole pages padded to a power of two (the
    sizes the engine's swap copies compile at)."""
    pages = math.ceil(tokens / workload.page_size)
    nbytes = (1 << (pages - 1).bit_length()) * workload.page_size
    nbytes *= workload.model.kv_bytes_per_token()
    return 2 * nbytes / timing.kv_swap_bytes_per_s


def train_seq_len(workload: Workload, prompt_tokens, response_tokens) -> int:
    """The padded sequence length of a training batch (the controller's padding,
    rlax_tpu.shapes.padded_seq_len of its longest prompt + response): one compiled shape."""
    longest = max(p + r for p, r in zip(prompt_tokens, response_tokens, strict=True))
    return padded_seq_len(longest, workload.max_seq_len)


def train_tokens(workload: Workload, prompt_tokens, response_tokens) -> int:
    """Token slots one train step computes for a batch (sequences in batch order, the
    mini-batches consecutive chunks of it). Padded (trainer.tokens_per_row = 0): every row
    at the batch's padded length (`train_seq_len`). Packed: each mini-batch's sequences
    (prompt + response) packed by first fit into rows of tokens_per_row tokens, and only
    the micro-batches of micro_batch_size rows that hold them run. The per-token cost is
    that of the whole step, so its recompute (the trainer packs the whole batch as one
    chunk for it: about as many rows) scales alike. With shared prompts
    (`workload.share_prefixes`) a group's rows in a mini-batch (consecutive, as the
    controller lays them) are units holding their prompt once (`shared_prompt_units`)."""
    if not workload.tokens_per_row:
        return len(response_tokens) * train_seq_len(workload, prompt_tokens, response_tokens)
    lengths = [
        min(p + r, workload.max_seq_len)
        for p, r in zip(prompt_tokens, response_tokens, strict=True)
    ]
    mini, micro, width = (
        workload.mini_batch_size,
        workload.micro_batch_size,
        workload.tokens_per_row,
    )

    def sizes(start: int) -> list[int]:
        chunk = range(start, min(start + mini, len(lengths)))
        if not workload.share_prefixes:
            return [lengths[i] for i in chunk]
        out = []
        for group in itertools.groupby(chunk, key=lambda i: i // workload.samples_per_prompt):
            rows = list(group[1])
            shared = min(prompt_tokens[rows[0]], workload.max_seq_len) - 1  # up to its last
            group_lengths = [lengths[i] for i in rows]
            if shared < 1:  # nothing before the first response target: no row shares
                out += group_lengths
                continue
            for unit in shared_prompt_units(shared, group_lengths, width):
                out.append(shared_unit_size(shared, [group_lengths[i] for i in unit]))
        return out

    micro_batches = sum(
        math.ceil(first_fit(sizes(start), width)[2] / micro)
        for start in range(0, len(lengths), mini)
    )
    return micro_batches * micro * width


def train_s(timing: TimingModel, workload: Workload, prompt_tokens, response_tokens) -> float:
    """One train step (without the publish) on its `train_tokens`: rows padded as the
    controller pads them (rlax_tpu.shapes.padded_seq_len of the batch's longest prompt +
    response), or packed."""
    tokens = train_tokens(workload, prompt_tokens, response_tokens)
    return timing.train_fixed_s + tokens * timing.train_s_per_token


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
