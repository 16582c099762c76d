"""The config sections of a run and the `RunConfig` that holds them.

Sizes that depend on each other are named once and derived (global batch =
prompts_per_batch × samples_per_prompt; the parameter server's hot-version count
defaults to N // η + 2). Cross-section rules live in `RunConfig.validate`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from typing import Any, Literal

from rlax_tpu.config.algorithm import RENAMED_ALGORITHM_FIELDS, AlgorithmConfig
from rlax_tpu.config.base import ConfigBase, ConfigError, require, unmove_renamed
from rlax_tpu.config.distribution import Distribution

DType = Literal["float32", "bfloat16"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# The smallest automatic decode bucket (InferenceConfig.decode_buckets).
MIN_DECODE_BUCKET = 64
RematPolicy = Literal[
    "none", "full", "minimal", "save_qkv_proj", "save_out_proj", "save_dot_except_mlp"
]

# Logical axis name -> mesh axes (a tuple, possibly empty = replicated). The model
# annotates every parameter and activation with logical names; these rules place them.
DEFAULT_LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", ()),
    ("layers", ()),  # the stacked decoder layers of trainer.scan_layers
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("norm", ()),
    ("value", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
)


def needs_rollout_logprobs(algorithm: AlgorithmConfig) -> bool:
    """Whether `algorithm` has a rollout correction (TIS/MIS, the mismatch gate): it reads the
    inference workers' own log-probs π_rollout next to the trainer's π_old. The JAX-free
    twin of `Objective.needs_rollout_logprobs` (both read
    `AlgorithmConfig.rollout_correction_fields`)."""
    return bool(algorithm.rollout_correction_fields())


def greedy_baseline(algorithm: AlgorithmConfig) -> bool:
    """Whether `algorithm` (resolved) subtracts a greedy baseline (ReMax,
    advantage="remax"): the controller then also generates and judges one greedy response
    per prompt and sends its reward as the group's `baseline_rewards`."""
    c = algorithm.resolved()
    return c.is_policy_gradient and c.advantage == "remax"


def rollout_correction_conflict(algorithm: AlgorithmConfig) -> str:
    """Why trainer.behaviour_logprobs="cached" cannot go with `algorithm`'s rollout
    correction, and the fix (the message of RunConfig's check and of the trainer's)."""
    fields = (
        " and ".join(f"trainer.algorithm.{f}" for f in algorithm.rollout_correction_fields())
        or "a rollout correction"
    )
    return (
        f"is 'cached', but trainer.algorithm {algorithm.name!r} has {fields}, which weighs "
        "π_old / π_rollout; with cached behaviour log-probs π_old would be the inference "
        "workers' π_rollout itself and the correction would be 1 on every token. Set "
        "trainer.behaviour_logprobs=recomputed (the trainer recomputes π_old and keeps the "
        "workers' log-probs as π_rollout), or turn the correction off "
        "(trainer.algorithm.rollout_correction=none, "
        "trainer.algorithm.rollout_is.gate_threshold=0)"
    )


@dataclasses.dataclass(kw_only=True, frozen=True)
class RopeScalingConfig(ConfigBase):
    """RoPE frequency scaling.

    `llama3` is Llama 3.1's piecewise scaling; `linear` divides positions by `factor`.
    """

    # llama3: Llama 3.1's piecewise scaling; linear: positions divided by factor
    type: Literal["llama3", "linear"] = "llama3"
    # how much longer a context the scaled model takes
    factor: float = 8.0
    # llama3: wavelengths above original / this are scaled fully
    low_freq_factor: float = 1.0
    # llama3: wavelengths below original / this are not scaled
    high_freq_factor: float = 4.0
    # llama3: the context the model was trained at
    original_max_position_embeddings: int = 8192

    PRESETS = {"llama3": lambda: RopeScalingConfig()}

    def validate(self) -> None:
        require(self.factor >= 1.0, "factor", f"must be >= 1, got {self.factor}")
        if self.type == "llama3":
            require(
                self.high_freq_factor > self.low_freq_factor,
                "high_freq_factor",
                f"must exceed low_freq_factor ({self.low_freq_factor}), "
                f"got {self.high_freq_factor}",
            )
            require(
                self.original_max_position_embeddings > 0,
                "original_max_position_embeddings",
                "must be positive",
            )


# The projections LoRA may adapt, by their Hugging Face (and PEFT) module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(kw_only=True, frozen=True)
class LoraConfig(ConfigBase):
    """Low-rank adapters (LoRA, Hu et al. 2021) on the named projections: each adapted weight
    W is used as W + (alpha / rank) · A B with A: [in, rank], B: [rank, out]. The trainer
    trains A and B only (the base is frozen: no gradient, no optimizer state), publishes
    only them, and workers add them in the matmul on the base they hold once."""

    # the adapters' rank r
    rank: int = 8
    # the adapters' scale is alpha / rank (PEFT's lora_alpha)
    alpha: float = 16.0
    # the projections adapted, by Hugging Face module name (see LORA_TARGETS)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    # `--set model.lora=attention` (q/k/v/o) or `=all_linear` (and the MLP), then e.g.
    # `--set model.lora.rank=16`.
    PRESETS = {
        "attention": lambda: LoraConfig(),
        "all_linear": lambda: LoraConfig(targets=LORA_TARGETS),
    }

    def validate(self) -> None:
        require(self.rank > 0, "rank", f"must be positive, got {self.rank}")
        require(self.alpha > 0, "alpha", f"must be positive, got {self.alpha}")
        require(bool(self.targets), "targets", f"name at least one of {list(LORA_TARGETS)}")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        require(
            not unknown,
            "targets",
            f"unknown projections {unknown}; LoRA adapts any of {list(LORA_TARGETS)}",
        )
        require(len(set(self.targets)) == len(self.targets), "targets", "names a projection twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelConfig(ConfigBase):
    """A decoder-only transformer of the Llama 3 / Qwen2 / Qwen3 family."""

    # Hugging Face architecture name, used on export ("LlamaForCausalLM", ...).
    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"] = (
        "LlamaForCausalLM"
    )
    # tokens of the vocabulary (rows of the embedding)
    vocab_size: int = 256
    # width of the residual stream
    hidden_size: int = 64
    # width of each MLP's hidden layer
    intermediate_size: int = 128
    # decoder layers
    num_layers: int = 2
    # query heads of each attention layer
    num_heads: int = 4
    # key/value heads (grouped-query attention; divides num_heads)
    num_kv_heads: int = 2
    # width of one attention head
    head_dim: int = 16
    # RoPE base frequency
    rope_theta: float = 10000.0
    # RoPE frequency scaling (None = none; preset llama3)
    rope_scaling: RopeScalingConfig | None = None
    # epsilon of every RMSNorm
    rms_norm_eps: float = 1e-6
    # the longest context (prompt + response) the model takes
    max_position_embeddings: int = 2048
    # the output head reuses the input embedding
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    value_head: bool = False  # scalar value head for PPO/GAE
    # Three dtypes: the trainer's master weights (and optimizer state), the compute dtype of
    # matmuls (norms, softmax and logits stay float32), and the weights the trainer
    # publishes, the parameter server stores and inference workers serve ("" = param_dtype).
    param_dtype: DType = "float32"
    # the compute dtype of matmuls and of the KV cache (see param_dtype)
    dtype: DType = "float32"
    # the dtype of published weights (see param_dtype)
    publish_dtype: Literal["", "float32", "bfloat16"] = ""
    # Where the initial weights come from: "" = random init from the run seed, else a
    # Hugging Face checkpoint directory (local path or gs://) with config.json + safetensors.
    hf_checkpoint: str = ""
    # Directory with tokenizer.json (and tokenizer_config.json for the chat template);
    # "" = the hf_checkpoint directory.
    tokenizer: str = ""
    # Low-rank adapters trained on a frozen base (None = full fine-tuning); see LoraConfig.
    lora: LoraConfig | None = None

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads ({self.num_heads}) for grouped-query attention, "
            f"got {self.num_kv_heads}",
        )
        require(self.rope_theta > 0, "rope_theta", "must be positive")
        require(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")

    @property
    def published_dtype(self) -> DType:
        """The dtype of the weights the trainer publishes (publish_dtype, "" = param_dtype)."""
        return self.publish_dtype or self.param_dtype

    def kv_bytes_per_token(self, dtype_bytes: float | None = None) -> float:
        """KV-cache bytes one token of context holds: keys and values of every layer, in
        `dtype_bytes` per element (default: those of the compute dtype, the cache's)."""
        if dtype_bytes is None:
            dtype_bytes = DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def served(self) -> ModelConfig:
        """The model inference workers build and serve: this one with param_dtype = the
        published dtype (the arrays they pull have it); compute dtype, KV cache and
        architecture unchanged. Idempotent; the identity when nothing is cast."""
        if self.param_dtype == self.published_dtype:
            return self
        return dataclasses.replace(self, param_dtype=self.published_dtype)


# TPU chip generations (the names libtpu's topologies use), and the GKE accelerator node
# label (cloud.google.com/gke-tpu-accelerator) of each.
TPU_CHIPS = ("v4", "v5e", "v5p", "v6e")
TPU_ACCELERATORS = {
    "tpu-v4-podslice": "v4",
    "tpu-v5-lite-podslice": "v5e",
    "tpu-v5-lite-device": "v5e",
    "tpu-v5p-slice": "v5p",
    "tpu-v6e-slice": "v6e",
}
_MESH_TOPOLOGY = re.compile(r"^(" + "|".join(TPU_CHIPS) + r"):[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def topology_chips(topology: str) -> int:
    """Chips of a topology: "v5p:2x4x4" or "2x4x4" -> 32."""
    return math.prod(int(d) for d in topology.rpartition(":")[2].split("x"))


@dataclasses.dataclass(kw_only=True, frozen=True)
class MeshConfig(ConfigBase):
    """A device mesh with axes (data, fsdp, tensor). One size may be -1: all remaining devices."""

    # devices along the data axis (-1 = all remaining)
    data: int = 1
    # devices along the fsdp axis, sharding parameters (-1 = all remaining)
    fsdp: int = -1
    # devices along the tensor axis, sharding heads and MLP (-1 = all remaining)
    tensor: int = 1
    # logical axis name -> the mesh axes it is sharded over
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_LOGICAL_AXIS_RULES
    # The TPU slice this mesh runs on, "<chip>:<chips along each axis>" with chip v4 | v5e |
    # v5p | v6e ("v5p:2x4x4" is a v5p-64: 32 chips). `rlax-tpu compile` compiles every
    # program for it on any host. "" = the run's deploy slice (deploy.trainer_tpu /
    # deploy.inference_tpu); when set, it must agree with that slice (RunConfig.validate).
    topology: str = ""
    # TPU multi-slice: the mesh spans `num_slices` slices of `topology` (the one source of the
    # slice count: deploy renders one Job per slice of deploy.trainer_tpu), num_slices × its
    # chips. `dcn_axis` crosses the slices over the data-center network: its size is a
    # multiple of num_slices, each slice holding one contiguous block of it; the other axes
    # stay inside a slice (ICI). The trainer only: an inference worker is one slice.
    num_slices: int = 1
    # the axis across the slices (see num_slices)
    dcn_axis: Literal["data", "fsdp"] = "data"

    AXES = ("data", "fsdp", "tensor")

    def validate(self) -> None:
        sizes = [self.data, self.fsdp, self.tensor]
        for axis, size in zip(self.AXES, sizes, strict=True):
            require(size == -1 or size >= 1, axis, f"must be >= 1 or -1 (the rest), got {size}")
        require(
            sizes.count(-1) <= 1,
            "fsdp",
            "at most one mesh axis may be -1 (meaning: all remaining devices)",
        )
        require(
            self.num_slices >= 1,
            "num_slices",
            f"must be >= 1 (1 = one slice, no DCN axis), got {self.num_slices}",
        )
        dcn = getattr(self, self.dcn_axis)
        require(
            dcn == -1 or dcn % self.num_slices == 0,
            self.dcn_axis,
            f"is {dcn}, but {self.dcn_axis} is the axis across the {self.num_slices} slices "
            f"(dcn_axis): its size must be a multiple of num_slices={self.num_slices}; set "
            f"{self.dcn_axis}={self.num_slices} (or a multiple, or -1), or dcn_axis to the "
            "other of data / fsdp",
        )
        # After the sizes: shape_for assumes each is >= 1 or -1.
        if self.topology:
            require(
                bool(_MESH_TOPOLOGY.match(self.topology)),
                "topology",
                f"must be <chip>:<chips along each axis> with chip one of "
                f"{', '.join(TPU_CHIPS)}, like v5p:2x4x4 or v5e:4x4; got {self.topology!r}",
            )
            chips = topology_chips(self.topology) * self.num_slices
            try:
                self.shape_for(chips)
            except ConfigError as e:
                raise ConfigError(
                    f"the mesh must fill its topology {self.slices_text()} ({chips} chips): "
                    f"{e.detail}",
                    field="topology",
                ) from None
        seen = set()
        for logical, mesh_axes in self.logical_axis_rules:
            require(logical not in seen, "logical_axis_rules", f"{logical!r} appears twice")
            seen.add(logical)
            for axis in mesh_axes:
                require(
                    axis in self.AXES,
                    "logical_axis_rules",
                    f"rule for {logical!r} names mesh axis {axis!r}; mesh axes are {self.AXES}",
                )

    def shape_for(self, num_devices: int) -> dict[str, int]:
        """Axis sizes for `num_devices` devices, resolving -1; raises if they don't fit."""
        sizes = {axis: getattr(self, axis) for axis in self.AXES}
        fixed = 1
        for size in sizes.values():
            fixed *= size if size != -1 else 1
        for axis, size in sizes.items():
            if size == -1:
                if num_devices % fixed:
                    raise ConfigError(
                        f"mesh {sizes} cannot fill {num_devices} devices: the fixed axes "
                        f"({fixed}) must divide the device count",
                        field=axis,
                    )
                sizes[axis] = num_devices // fixed
        total = 1
        for size in sizes.values():
            total *= size
        if total != num_devices:
            raise ConfigError(
                f"mesh {sizes} needs {total} devices but {num_devices} are available; "
                "set one axis to -1 or change the sizes",
                field="fsdp",
            )
        if self.num_slices > 1 and (
            num_devices % self.num_slices or sizes[self.dcn_axis] % self.num_slices
        ):
            raise ConfigError(
                f"mesh {sizes} over {num_devices} devices in {self.num_slices} slices: "
                f"{self.dcn_axis} (dcn_axis, the axis across the slices) must be a multiple "
                f"of num_slices={self.num_slices}; set {self.dcn_axis}={self.num_slices} or "
                "change the other axes",
                field=self.dcn_axis,
            )
        return sizes

    def slice_shapes(self, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
        """(within one slice, across the slices): the axis sizes of one slice's block (ICI)
        and how many slices each axis spans (DCN: num_slices along dcn_axis, 1 elsewhere);
        their products are `shape_for(num_devices)`."""
        sizes = self.shape_for(num_devices)
        dcn = {axis: 1 for axis in self.AXES}
        dcn[self.dcn_axis] = self.num_slices
        ici = {axis: sizes[axis] // dcn[axis] for axis in self.AXES}
        return ici, dcn

    def slices_text(self) -> str:
        """The slices this mesh spans, for messages: "v5p:2x4x4", or "2 × v5p:2x4x4"."""
        topology = self.topology or "its slice"
        return topology if self.num_slices == 1 else f"{self.num_slices} × {topology}"


def _validate_gpu(gpu: str, memory_fraction: float, mesh: MeshConfig) -> None:
    """The GPU fields of the trainer's and the inference workers' sections."""
    require(
        0 < memory_fraction <= 1,
        "gpu_memory_fraction",
        f"must be in (0, 1], got {memory_fraction}",
    )
    if not gpu:
        return
    model, _, count = gpu.partition(":")
    require(
        bool(re.fullmatch(r"[a-z0-9][a-z0-9-]*", model))
        and (not count or (count.isdigit() and int(count) >= 1)),
        "gpu",
        f'must be "<model>" or "<model>:<count>" like h100 or a100-80gb:2, got {gpu!r}',
    )
    require(
        not mesh.topology,
        "gpu",
        f"names GPUs ({gpu}) while mesh.topology names a TPU slice ({mesh.topology}): "
        "clear one of them",
    )
    require(
        mesh.num_slices == 1,
        "gpu",
        f"names GPUs ({gpu}) while mesh.num_slices={mesh.num_slices} asks for TPU "
        "multi-slice: set mesh.num_slices=1, or clear gpu for a TPU slice",
    )
    try:
        mesh.shape_for(int(count or 1))
    except ConfigError as e:
        raise ConfigError(
            f"the mesh must fill the GPUs of gpu={gpu!r}: {e.detail}", field="gpu"
        ) from None


@dataclasses.dataclass(kw_only=True, frozen=True)
class StalenessConfig(ConfigBase):
    """The two staleness knobs (DESIGN §2).

    reload_every (η): inference workers load only versions that are multiples of η.
    max_staleness (N): batch s trains only on rollouts of versions v with s - v <= N.
    """

    # η: inference workers load only versions that are multiples of η
    reload_every: int = 1
    # N: batch s trains only on rollouts of versions v with s - v <= N
    max_staleness: int = 0
    # deterministic: batch b is generated by version g(b) once it is published; freshest: by
    # the newest acceptable loadable version
    schedule: Literal["deterministic", "freshest"] = "deterministic"

    PRESETS = {
        "on_policy": lambda: StalenessConfig(reload_every=1, max_staleness=0),
        "one_step_off_policy": lambda: StalenessConfig(reload_every=1, max_staleness=1),
        # RLAX's main run: workers reload every 16 versions, rollouts up to 32 versions old.
        "off_policy": lambda: StalenessConfig(reload_every=16, max_staleness=32),
    }

    def validate(self) -> None:
        require(
            self.reload_every >= 1,
            "reload_every",
            f"η must be >= 1 (1 = workers may load every version), got {self.reload_every}",
        )
        require(
            self.max_staleness >= 0,
            "max_staleness",
            f"N must be >= 0 (0 = on-policy), got {self.max_staleness}",
        )
        require(
            self.max_staleness >= self.reload_every - 1,
            "max_staleness",
            f"N={self.max_staleness} < η-1={self.reload_every - 1}: workers that reload only "
            f"every {self.reload_every} versions produce rollouts up to {self.reload_every - 1} "
            f"versions old, which could never be trained on; set max_staleness >= "
            f"{self.reload_every - 1} or lower reload_every",
        )

    @property
    def paradigm(self) -> str:
        if (self.reload_every, self.max_staleness) == (1, 0):
            return "on_policy"
        if (self.reload_every, self.max_staleness) == (1, 1):
            return "one_step_off_policy"
        return "off_policy"


@dataclasses.dataclass(kw_only=True, frozen=True)
class OptimizerConfig(ConfigBase):
    """AdamW behind global-norm gradient clipping, with a learning-rate schedule counted in
    train steps (rlax_tpu.trainer.step.build_optimizer): `trainer.optimizer`."""

    learning_rate: float = 1e-6  # the peak learning rate, reached after warmup_steps
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after the warmup
    warmup_steps: int = 0  # train steps of linear warmup from 0 to learning_rate
    # Train steps over which cosine / linear decay to 0 (0 = controller.num_steps, which
    # then becomes part of the run's identity: a run cannot be extended without changing
    # its schedule).
    lr_decay_steps: int = 0
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_b1: float = 0.9  # Adam's first-moment decay
    adam_b2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's epsilon, added to the root of the second moment
    grad_clip_norm: float = 1.0  # the gradients' global norm is clipped to this

    def validate(self) -> None:
        require(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.lr_decay_steps >= 0, "lr_decay_steps", "must be >= 0 (0 = num_steps)")
        require(0 <= self.adam_b1 < 1, "adam_b1", "must be in [0, 1)")
        require(0 <= self.adam_b2 < 1, "adam_b2", "must be in [0, 1)")
        require(self.grad_clip_norm > 0, "grad_clip_norm", "must be > 0")


@dataclasses.dataclass(kw_only=True, frozen=True)
class WarmStartConfig(ConfigBase):
    """The SFT warm start before RL (the demo), run by the trainer on the training datasets'
    reference answers: `trainer.warm_start`. Its optimizer is trainer.optimizer's (AdamW,
    clipping, warmup, schedule) at its own learning rate, the schedule over its own steps."""

    # SFT steps before RL; version 0 is the model after them. 0 = start RL from the model
    # as is.
    steps: int = 0
    learning_rate: float = 1e-3  # the warm start's peak learning rate
    # The trainer checkpoints the warm start every this many SFT steps (and on a stop and
    # after its last step), so a crash during it loses at most this many steps: `rlax-tpu
    # resume` continues from the newest. 0 = only on a stop and at the end.
    checkpoint_every: int = 200

    def validate(self) -> None:
        require(self.steps >= 0, "steps", "must be >= 0")
        require(self.learning_rate > 0, "learning_rate", "must be > 0")
        require(
            self.checkpoint_every >= 0,
            "checkpoint_every",
            "must be >= 0 (0 = checkpoint the warm start only on a stop and at its end)",
        )

    def optimizer(self, trainer: OptimizerConfig) -> OptimizerConfig:
        """The warm start's optimizer: `trainer`'s at this learning rate, decaying (when its
        schedule does) over the warm start's steps."""
        return dataclasses.replace(trainer, learning_rate=self.learning_rate, lr_decay_steps=0)


@dataclasses.dataclass(kw_only=True, frozen=True)
class TrainerConfig(ConfigBase):
    mesh: MeshConfig = MeshConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    # Sequences per optimizer update; the global batch is split into global/mini updates.
    mini_batch_size: int = 8
    # Sequences per forward/backward pass; gradients accumulate over mini/micro passes.
    micro_batch_size: int = 8
    max_seq_len: int = 256  # tokens of a training sequence: prompt and response
    # Packed batches (docs/trainer.md, "Packed batches"): each mini-batch's sequences are
    # packed by first fit into rows of this many tokens, micro_batch_size rows per packed
    # micro-batch, and only the micro-batches holding tokens run (micro-batching splits by
    # tokens). 0 = off: every sequence padded to the batch's length in a row of its own.
    # At least max_seq_len (a sequence never spans rows).
    tokens_per_row: int = 0
    # Shared prompts (docs/trainer.md, "Shared prompts"): with packed rows, the samples of a
    # mini-batch that share a prompt (a GRPO group) hold it once in a packed row and attend
    # to it there, so the update runs the prompt's tokens once per group, not once per
    # sample; the same objective within float rounding. Needs tokens_per_row > 0 and an
    # attention that takes a prompt's segment (jax on every platform, auto off TPU).
    share_prefixes: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    # Memory of the training forward (docs/trainer.md, "Memory"). remat_policy: what each
    # decoder layer keeps for the backward pass ("none" keeps everything, "full" only the
    # layer's input, the others also keep the named matmul outputs; MaxText's names).
    remat_policy: RematPolicy = "none"
    # Decoder layers stacked on a leading axis and run by one scan: compile time does not
    # grow with depth. The trainer's params and checkpoints are stacked; what it publishes
    # (and HF import/export) is per layer.
    scan_layers: bool = False
    # Training attention: "auto" = splash attention on TPU, jax.nn.dot_product_attention on
    # GPU, the reference (float32 scores) on CPU; "jax" = the reference everywhere;
    # "pallas" = the splash kernel (interpreted off TPU).
    attention_backend: Literal["auto", "jax", "pallas"] = "auto"
    # Tokens per chunk of the log-prob / entropy head: [chunk, vocab] float32 logits live at
    # a time instead of [micro-batch tokens, vocab]; 0 = the whole micro-batch at once.
    logprob_chunk_size: int = 0
    # Which behaviour log-probs enter the importance weight: the trainer's recomputed
    # π_old (RLAX §5, default) or the inference workers' cached ones.
    behaviour_logprobs: Literal["recomputed", "cached"] = "recomputed"
    # With cached behaviour log-probs the π_old recompute (a forward pass over the batch)
    # only feeds the train/inference mismatch metrics (mismatch/*, logprob_diff/recomputed_*):
    # it runs on steps that are multiples of this (0 = never). Recomputed log-probs, and
    # GAE's V_old, are computed every step whatever this says.
    recompute_every: int = 10
    # the trainer checkpoints every this many train steps
    checkpoint_every: int = 16
    # Executables `rlax-tpu compile CONFIG --save-compiled DIR` saved for this config's
    # topology: the trainer loads those of its mesh and programs instead of compiling them
    # at start-up, and refuses to start on ones compiled for another program or mesh.
    # "" = compile at start-up.
    compiled_dir: str = ""
    # checkpoints kept; older ones are deleted
    max_checkpoints_to_keep: int = 3
    # The largest gRPC message of TrainStep / SftStep: the controller streams a batch of any
    # size in chunks below it, and `serve trainer` refuses larger messages. Larger chunks
    # are no faster and cost host memory on both ends (docs/trainer.md, "The wire").
    max_message_bytes: int = 2**20
    # The share of each GPU's memory the trainer process takes when the local launcher runs
    # it next to the inference workers on the same GPUs (XLA_PYTHON_CLIENT_MEM_FRACTION;
    # docs/gpu_tpu_recipes.md). The colocated shares must sum to at most 1. Ignored on
    # CPU and TPU.
    gpu_memory_fraction: float = 0.55
    # The GPUs the trainer runs on when not on a TPU slice, "<model>[:<count>]" (h100,
    # a100-80gb:2; models in rlax_tpu/hardware.py): `rlax-tpu compile` checks its
    # programs against gpu_memory_fraction of one such GPU. "" = a TPU slice (mesh.topology,
    # else deploy.trainer_tpu).
    gpu: str = ""

    def validate(self) -> None:
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _validate_gpu(self.gpu, self.gpu_memory_fraction, self.mesh)
        require(
            2**10 <= self.max_message_bytes <= 256 * 2**20,
            "max_message_bytes",
            f"must be between 1 KiB and 256 MiB, got {self.max_message_bytes}",
        )
        require(
            self.mini_batch_size % self.micro_batch_size == 0,
            "micro_batch_size",
            f"must divide mini_batch_size ({self.mini_batch_size}), got {self.micro_batch_size}",
        )
        require(self.max_seq_len >= 2, "max_seq_len", "must be >= 2")
        require(
            self.tokens_per_row == 0 or self.tokens_per_row >= self.max_seq_len,
            "tokens_per_row",
            f"must be 0 (packing off) or at least max_seq_len ({self.max_seq_len}): a packed "
            f"row holds whole sequences, got {self.tokens_per_row}; set "
            f"trainer.tokens_per_row={self.max_seq_len} or more (the same activation memory "
            "per micro-batch as padded rows at that value), or 0",
        )
        require(
            not self.share_prefixes or self.tokens_per_row > 0,
            "share_prefixes",
            "shares prompts within packed rows: set trainer.tokens_per_row (at least "
            f"max_seq_len, {self.max_seq_len}; room for a group's prompt and its samples' "
            "responses is what it saves), or trainer.share_prefixes=false",
        )
        require(
            not (self.share_prefixes and self.attention_backend == "pallas"),
            "share_prefixes",
            "needs an attention that takes a shared prompt's segment, and splash attention "
            "(attention_backend=pallas) compares segment ids for equality only: set "
            "trainer.attention_backend=jax, or trainer.share_prefixes=false",
        )
        require(
            self.logprob_chunk_size >= 0,
            "logprob_chunk_size",
            f"must be >= 0 (0 = unchunked), got {self.logprob_chunk_size}",
        )
        require(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        require(self.recompute_every >= 0, "recompute_every", "must be >= 0 (0 = never)")
        require(self.max_checkpoints_to_keep >= 1, "max_checkpoints_to_keep", "must be >= 1")


@dataclasses.dataclass(kw_only=True, frozen=True)
class InferenceConfig(ConfigBase):
    mesh: MeshConfig = MeshConfig(data=1, fsdp=1, tensor=-1)
    # inference worker processes (each on its own devices)
    num_workers: int = 1
    # sequences a worker decodes at once
    max_decode_slots: int = 8
    # tokens per KV-cache page (a power of two)
    page_size: int = 16
    # Bytes of device memory given to the KV page pool (per worker).
    kv_cache_bytes: int = 64 * 2**20
    # prompt lengths prefill is compiled for; a prompt is padded to the next
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256)
    # Waiting prompts prefilled together in one device call: the rows of every prefill
    # call (padded). Raise it (e.g. 8) when many short prompts arrive at once, as a small
    # model's RL batch does; 1 (one prompt per call) wastes nothing on padding rows.
    prefill_batch_size: int = 1
    # Samples of one prompt admitted together (a GRPO group) share its prefill and its KV
    # pages: the prompt is prefilled in one row, every sample's first token is sampled from
    # that row's logits with its own key, and the samples hold the prompt's full pages
    # together (reference-counted, read-only), each with its own copy of the last, partial
    # page. Bitwise the tokens and log-probs of prefilling each sample on its own (docs/
    # inference.md, "Shared prompt pages"). False: each sample is prefilled alone.
    share_prompt_pages: bool = True
    # Prompts kept after their prefill (0 = none): each one's KV pages and the logits of its
    # last position, keyed by (context tokens, weight version), so a sample of it admitted
    # in a later round (a group larger than the free slots, a prompt repeated in an
    # evaluation) takes its pages and draws its first token from those logits instead of
    # being prefilled again, bitwise as its own prefill would. Least recently used first
    # out, and whenever the pool needs the pages; a weight load clears it. Costs a float32
    # row of vocab_size per entry on the device.
    prefix_cache_entries: int = 0
    # the longest prompt in tokens (longer ones: controller.overlong_prompts)
    max_prompt_len: int = 128
    # the longest response in tokens
    max_new_tokens: int = 64
    # sampling temperature (0 = greedy)
    temperature: float = 1.0
    # nucleus sampling: the smallest set of tokens with this much mass (1 = off)
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    # tokens that end a response (besides the tokenizer's end of sequence)
    stop_token_ids: tuple[int, ...] = ()
    # Behaviour log-probs are of the temperature-scaled full distribution ("full") or
    # of the top-k/top-p truncated distribution actually sampled from ("sampled").
    logprobs_of: Literal["full", "sampled"] = "full"
    # as trainer.attention_backend, for prefill and decode
    attention_backend: Literal["auto", "jax", "pallas"] = "auto"
    # How requests get KV pages. "on_demand": the prompt's pages at admission, one more
    # whenever a sequence crosses a page boundary; when the pool runs out, the most recently
    # admitted sequence is swapped out to host memory and swapped back in when pages free
    # up (bitwise: its tokens and log-probs are those of an unpreempted run). "reserve":
    # pages for prompt + max_new_tokens reserved at admission, never swaps (fewer live
    # sequences; the engine before on-demand paging).
    kv_admission: Literal["on_demand", "reserve"] = "on_demand"
    # Rows of the compiled decode steps: each decode call runs the smallest that holds the
    # live sequences, so its cost follows them. () = powers of two from 64 up to
    # max_decode_slots (one size when max_decode_slots <= 64): XLA:CPU's matmuls give a row
    # the same bits at any row count from 64 up, not below, on an AMD EPYC host but not on an
    # Intel Xeon one (docs/inference.md); (max_decode_slots,) is bitwise on any host.
    decode_buckets: tuple[int, ...] = ()
    # The lengths the task is expected to have (tokens): `rlax-tpu compile`'s KV capacity in
    # concurrent sequences and the simulator's default workload. None: prompts fixed at
    # half of max_prompt_len; responses lognormal, median max_new_tokens / 4, sigma 1.
    prompt_tokens: Distribution | None = None
    # the expected response lengths (see prompt_tokens)
    response_tokens: Distribution | None = None
    # The share of each GPU's memory every inference worker process takes when the local
    # launcher runs it next to the trainer (XLA_PYTHON_CLIENT_MEM_FRACTION); the KV pool
    # (kv_cache_bytes) comes out of it. Ignored on CPU and TPU.
    gpu_memory_fraction: float = 0.35
    # The GPUs every inference worker runs on when not on a TPU slice, "<model>[:<count>]"
    # as trainer.gpu ("" = a TPU slice: mesh.topology, else deploy.inference_tpu).
    gpu: str = ""
    # While it generates, each worker fetches the next version it may load (the held one
    # + η) into host memory, the moment the parameter server commits it; its next load then
    # only places it on the devices. Costs one version of host memory per worker.
    prefetch_weights: bool = True
    # Executables `rlax-tpu compile CONFIG --save-compiled DIR` saved for this config's
    # topology (as trainer.compiled_dir): each worker runs those of its mesh (prefill and
    # decode at their buckets, the swap copies) instead of compiling them on first use, and
    # refuses to start on ones compiled for another program or mesh. "" = compile on use.
    compiled_dir: str = ""
    # What happens to the requests in flight when a worker loads a newer version (docs/
    # inference.md, "In-flight weight updates"). "off": they are aborted and generated
    # again under the new version (the whole response of one version). "resume": each keeps
    # its tokens so far and continues under the new weights after a fresh prefill of prompt
    # + tokens so far (RLAX's reading of LlamaRL; AReaL, verl, SkyRL). "keep": each keeps
    # its tokens and its KV pages and continues under the new weights (PipelineRL, NeMo-RL;
    # the old tokens' keys and values stay those of the old version). Either way a rollout
    # records the version of each token (mixed-version rollouts).
    in_flight_update: Literal["off", "resume", "keep"] = "off"
    # With in_flight_update on: the most new tokens a response generates per tick (one
    # train step's generation) before it is carried into the next tick, under the next
    # version (LlamaRL's "break down long generations"); a response may span N - η + 1
    # ticks and finishes in its last. 0 = max_new_tokens / (N - η + 1), rounded up.
    tick_tokens: int = 0
    # The dtype each worker holds the decoder layers' projection weights in (attention
    # q/k/v/o, MLP gate/up/down): "" = as published, bit for bit; "int8" or "fp8"
    # (float8_e4m3fn) = quantized by the worker at load, one float32 scale per output channel
    # (symmetric absmax), dequantized in the matmul: about half of bf16's weight memory and
    # bytes read per decode step. Embedding, lm_head, norms, LoRA adapters, the KV cache and
    # the compute dtype are unchanged. The behaviour log-probs then differ from the
    # trainer's: pair it with a rollout correction (trainer.algorithm.rollout_correction,
    # e.g. token-level TIS; docs/inference.md, "Quantized serving").
    weight_dtype: Literal["", "int8", "fp8"] = ""
    # One host, one process: the local launcher runs the (one) inference worker inside the
    # trainer's process, on the same devices, as Tunix and verl's hybrid engine do. The
    # trainer hands each version to the worker as device arrays (no pull over gRPC) and
    # sends it to the parameter server in the background; controller, staleness, snapshots
    # and results are those of the disaggregated run (docs/controller.md, "Co-located").
    colocated: bool = False
    # Co-located, which versions the trainer sends to the parameter server: "needed" = only
    # those a snapshot may rely on (each checkpoint's [oldest a resume generates with,
    # checkpoint]) and the run's last: on-policy and one step off-policy, only at
    # checkpoints; with max_staleness >= 2 * reload_every each version is still needed after
    # the worker drops it, so it is sent in the background. "every" = each version, in the
    # background while the worker generates, as a disaggregated run does. Either way the
    # process holds 2 copies of the served weights, and the run's weights are the same.
    colocated_publish: Literal["needed", "every"] = "needed"

    def validate(self) -> None:
        require(self.max_decode_slots >= 1, "max_decode_slots", "must be >= 1")
        require(
            not self.colocated or self.num_workers == 1,
            "num_workers",
            f"must be 1 with inference.colocated (the worker runs inside the trainer's "
            f"process), got {self.num_workers}: set inference.num_workers=1 or "
            "inference.colocated=false",
        )
        _validate_gpu(self.gpu, self.gpu_memory_fraction, self.mesh)
        require(
            self.mesh.num_slices == 1,
            "mesh.num_slices",
            f"must be 1, got {self.mesh.num_slices}: an inference worker runs on one slice "
            "(one host's chips: rlax_tpu/inference/server.py); run more workers "
            "(inference.num_workers) instead",
        )
        require(
            not self.decode_buckets
            or (
                list(self.decode_buckets) == sorted(set(self.decode_buckets))
                and self.decode_buckets[0] >= 1
                and self.decode_buckets[-1] == self.max_decode_slots
            ),
            "decode_buckets",
            "must be () (automatic) or positive, strictly increasing and end at "
            f"max_decode_slots ({self.max_decode_slots}), got {self.decode_buckets}",
        )
        require(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            "page_size",
            f"must be a power of two, got {self.page_size}",
        )
        require(self.kv_cache_bytes > 0, "kv_cache_bytes", "must be > 0")
        require(
            list(self.prefill_buckets) == sorted(set(self.prefill_buckets))
            and all(b > 0 for b in self.prefill_buckets),
            "prefill_buckets",
            f"must be positive and strictly increasing, got {self.prefill_buckets}",
        )
        require(
            bool(self.prefill_buckets) and self.prefill_buckets[-1] >= self.max_prompt_len,
            "prefill_buckets",
            f"the largest bucket must hold max_prompt_len ({self.max_prompt_len})",
        )
        require(
            1 <= self.prefill_batch_size <= self.max_decode_slots,
            "prefill_batch_size",
            f"must be between 1 and max_decode_slots ({self.max_decode_slots}), "
            f"got {self.prefill_batch_size}",
        )
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.prefix_cache_entries >= 0, "prefix_cache_entries", "must be >= 0 (0 = off)")
        require(
            self.share_prompt_pages or not self.prefix_cache_entries,
            "prefix_cache_entries",
            "a prefix cache shares pages: it needs share_prompt_pages=True",
        )
        require(self.tick_tokens >= 0, "tick_tokens", "must be >= 0 (0 = automatic)")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")

    @property
    def prefill_rows(self) -> int:
        """Rows of every prefill call."""
        return self.prefill_batch_size

    @property
    def sample_rows(self) -> int:
        """Samples every prefill call can draw first tokens for: prefill_rows, or with
        share_prompt_pages as many as there are decode slots (a multiple of prefill_rows,
        sampled prefill_rows at a time; the call samples only the blocks it uses)."""
        if not self.share_prompt_pages:
            return self.prefill_rows
        return -(-self.max_decode_slots // self.prefill_rows) * self.prefill_rows

    @property
    def decode_rows(self) -> tuple[int, ...]:
        """The compiled decode sizes (decode_buckets, resolved)."""
        if self.decode_buckets:
            return self.decode_buckets
        sizes, rows = [], MIN_DECODE_BUCKET
        while rows < self.max_decode_slots:
            sizes.append(rows)
            rows *= 2
        return (*sizes, self.max_decode_slots)

    def length_distributions(self) -> tuple[Distribution, Distribution]:
        """(prompt tokens, response tokens) expected: `prompt_tokens` / `response_tokens` or
        their defaults, clipped to [1, max_prompt_len] and [1, max_new_tokens]."""
        prompt = self.prompt_tokens or Distribution(median=max(1, self.max_prompt_len // 2))
        response = self.response_tokens or Distribution(
            kind="lognormal", median=max(1.0, self.max_new_tokens / 4), sigma=1.0
        )

        def clipped(d: Distribution, most: int) -> Distribution:
            top = min(d.maximum or most, most)
            return dataclasses.replace(d, minimum=max(1.0, d.minimum), maximum=top)

        return clipped(prompt, self.max_prompt_len), clipped(response, self.max_new_tokens)


@dataclasses.dataclass(kw_only=True, frozen=True)
class ParamServerConfig(ConfigBase):
    # parameter-server processes; the versions are split over them
    num_replicas: int = 1
    # Versions kept in memory (K); None = N // η + 2 from the staleness knobs (only the
    # versions workers may load, multiples of η, and the final one are published).
    hot_versions: int | None = None
    # bytes of one streamed Publish / Pull message
    chunk_bytes: int = 2 * 2**20
    # the address the parameter servers listen on
    host: str = "127.0.0.1"
    # Environment variable holding the shared auth token of all components.
    auth_token_env: str = "RLAX_TPU_AUTH_TOKEN"

    def validate(self) -> None:
        require(self.num_replicas >= 1, "num_replicas", "must be >= 1")
        require(self.hot_versions is None or self.hot_versions >= 1, "hot_versions", "must be >= 1")
        require(
            2**10 <= self.chunk_bytes <= 64 * 2**20,
            "chunk_bytes",
            f"must be between 1 KiB and 64 MiB, got {self.chunk_bytes}",
        )


@dataclasses.dataclass(kw_only=True, frozen=True)
class VerifierConfig(ConfigBase):
    # worker processes of the verifier service
    num_workers: int = 2
    # "" = `rlax-tpu run` starts its own verifier service; else host:port of verifier
    # services already running (comma-separated for several), started with the run's auth
    # token: the run connects to them and starts none.
    address: str = ""
    # where a math answer is read from a response, tried in order
    math_answer_extraction: tuple[str, ...] = ("boxed", "hash", "the_answer_is", "last_number")
    # seconds one math check may take (then TIME_LIMIT)
    math_timeout_s: float = 5.0
    # A reward function of the user's (docs/verifiers.md, "Rewards of your own") runs in the
    # math checks' worker pool under this deadline (then TIME_LIMIT, reward 0).
    reward_timeout_s: float = 5.0
    # languages code rows may use (rows of the language table)
    code_languages: tuple[str, ...] = ("python", "cpp")
    # CPU seconds per test of a code row
    code_time_limit_s: float = 2.0
    # address-space limit per test of a code row
    code_memory_limit_bytes: int = 512 * 2**20
    # stdout cap per test of a code row
    code_output_limit_bytes: int = 1 * 2**20
    # all_passed: 1 when every test passes; fraction_passed: the share passed
    code_reward: Literal["all_passed", "fraction_passed"] = "all_passed"
    # Running untrusted code without the bubblewrap sandbox is refused unless this is set
    # (also when bwrap cannot start as uid 65534 under a root verifier: never as root).
    allow_unsandboxed: bool = False
    sandbox_bwrap: str = "bwrap"  # the bubblewrap binary (a path or a name on PATH)
    # Each run's own cgroup (tasks, memory without swap, CPU): "auto" where the verifier may
    # manage its cgroup (v2, else v1), "off", or a cgroup v2 directory to create runs under.
    sandbox_cgroup: str = "auto"
    # The verifier's own workers (math, task scorers): address-space limit of each process.
    math_memory_limit_bytes: int = 2 * 2**30
    # Longer responses are cut to their last this-many bytes before anything reads them
    # (the final answer and the last code block are at the end); counted in the metrics.
    max_response_bytes: int = 1 * 2**20
    # The most CPU seconds a program run for the policy's tools (Execute: the "python" tool)
    # may ask for, and what it gets when it asks for none; its wall clock is 1 s more.
    execute_time_limit_s: float = 10.0
    # The most address space such a program may ask for (and gets when it asks for none).
    execute_memory_limit_bytes: int = 512 * 2**20
    # The most stdout such a program may ask for (likewise); stderr keeps its last
    # this-many bytes, 8 KiB at most.
    execute_output_limit_bytes: int = 64 * 2**10

    def validate(self) -> None:
        require(self.num_workers >= 1, "num_workers", "must be >= 1")
        for name in (
            "math_timeout_s",
            "reward_timeout_s",
            "code_time_limit_s",
            "execute_time_limit_s",
        ):
            require(getattr(self, name) > 0, name, "must be > 0")
        for address in self.addresses():
            host, _, port = address.rpartition(":")
            require(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                "address",
                f"must be host:port[,host:port...], got {self.address!r}",
            )
        for name in (
            "code_memory_limit_bytes",
            "math_memory_limit_bytes",
            "max_response_bytes",
            "execute_memory_limit_bytes",
            "execute_output_limit_bytes",
        ):
            require(getattr(self, name) > 0, name, "must be > 0")
        require(
            self.sandbox_cgroup in ("auto", "off") or self.sandbox_cgroup.startswith("/"),
            "sandbox_cgroup",
            f"must be auto, off or an absolute cgroup directory, got {self.sandbox_cgroup!r}",
        )

    def addresses(self) -> list[str]:
        """The verifier services of `address` (host:port each; [] = the run starts its own)."""
        return [a.strip() for a in self.address.split(",") if a.strip()]


@dataclasses.dataclass(kw_only=True, frozen=True)
class DatasetConfig(ConfigBase):
    """A dataset of prompts (docs/datasets.md): a JSONL or Parquet file, which of its fields
    hold what, and how its prompts are rendered for the model."""

    path: str  # JSONL or Parquet, local or gs://
    # its share of the prompt mixture, relative to the other datasets
    weight: float = 1.0
    # Which verifier scores its rows (a row's own "verifier" field overrides it); "function"
    # = the reward function `reward_function` names.
    verifier: Literal["math", "code", "arithmetic", "reasoning_gym", "function", "none"] = "math"
    # "module:function" (importable) or "path/to/file.py:function": the user's reward, run
    # by the verifier service (docs/verifiers.md, "Rewards of your own").
    reward_function: str = ""
    # The row fields holding each part ("question" for GSM8K); a row has the prompt field
    # (text) or the messages field (chat), not both. Fields not named here reach a reward
    # function as the row's metadata.
    prompt_field: str = "prompt"
    # the row field holding a chat (see prompt_field)
    messages_field: str = "messages"
    answer_field: str = "answer"  # the reference answer ("answer" also reads "reference")
    # The row field holding the SFT warm start's target when it is not the reference answer
    # (a worked solution ending in the answer, or a demonstration: a list of the assistant
    # turns and tool results after the prompt, for runs with controller.environment);
    # "" = the reference answer.
    sft_field: str = ""
    # the row field holding the row's id (see prompt_field)
    id_field: str = "id"
    # A system message put before every prompt (kept out when a row brings its own).
    system_prompt: str = ""
    # Text prompts go through the tokenizer's chat template (as one user message) when it
    # has one; False sends them as plain text. Chat rows are always templated.
    apply_chat_template: bool = True
    # Extra variables of the chat template, a JSON object: '{"enable_thinking": false}'.
    chat_template_kwargs: str = ""

    def validate(self) -> None:
        require(bool(self.path), "path", "must name a JSONL or Parquet file")
        require(self.weight > 0, "weight", f"must be > 0, got {self.weight}")
        require(
            (self.verifier == "function") == bool(self.reward_function),
            "reward_function" if self.verifier == "function" else "verifier",
            "verifier=function needs reward_function='module:function' (or 'file.py:function')"
            if self.verifier == "function"
            else f"reward_function={self.reward_function!r} is used only with "
            "verifier=function: set verifier=function too",
        )
        if self.reward_function:
            module, sep, function = self.reward_function.rpartition(":")
            require(
                bool(sep and module and function.isidentifier()),
                "reward_function",
                f"must be 'module:function' or 'path/to/file.py:function', got "
                f"{self.reward_function!r}",
            )
        for name in ("prompt_field", "messages_field", "answer_field", "id_field"):
            require(bool(getattr(self, name)), name, "must name a field of the rows")
        self.template_kwargs()

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs as a dict."""
        if not self.chat_template_kwargs:
            return {}
        try:
            kwargs = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"must be a JSON object like '{{\"enable_thinking\": false}}': {e}",
                field="chat_template_kwargs",
            ) from None
        require(
            isinstance(kwargs, dict),
            "chat_template_kwargs",
            f"must be a JSON object, got {self.chat_template_kwargs!r}",
        )
        return kwargs


@dataclasses.dataclass(kw_only=True, frozen=True)
class DynamicSamplingConfig(ConfigBase):
    """DAPO's dynamic sampling: a prompt group whose rewards are all equal carries no signal;
    it is dropped and the batch draws more prompts (its own snapshotted stream):
    `controller.dynamic_sampling`."""

    enabled: bool = False  # drop flat groups and draw more prompts
    # At most this many extra rounds of prompts per batch (then flat groups fill it).
    max_rounds: int = 3

    def validate(self) -> None:
        require(self.max_rounds >= 0, "max_rounds", "must be >= 0")


@dataclasses.dataclass(kw_only=True, frozen=True)
class ReplayConfig(ConfigBase):
    """TBA's replay buffer: `controller.replay`. Train on batches sampled from verified
    rollouts kept per prompt (each prompt: with probability recency_prob one that got data at
    the latest sync, else by softmax(mean reward / reward_temperature); 0 = uniform). New
    rollouts enter every sync_every steps; only rollouts with b - version <= N are ever
    sampled."""

    enabled: bool = False  # train on batches sampled from the buffer
    per_prompt_cap: int = 16  # rollouts kept per prompt (the oldest go first)
    global_cap: int = 4096  # rollouts kept in all
    # The chance that a batch's prompt is drawn among those that got data at the latest sync.
    recency_prob: float = 0.5
    # Otherwise prompts are drawn by softmax(mean reward / this); 0 = uniformly.
    reward_temperature: float = 1.0
    sync_every: int = 1  # new rollouts enter the buffer every this many steps
    # Replay mode generates batch b with version b - lag (not b - N), so a rollout stays
    # acceptable for N - lag more steps of reuse.
    generation_lag: int = 1
    # Batches generated with version 0 into the buffer before the first step (TBA pre-fill).
    prefill_batches: int = 0

    def validate(self) -> None:
        require(self.per_prompt_cap >= 1, "per_prompt_cap", "must be >= 1")
        require(
            self.global_cap >= self.per_prompt_cap,
            "global_cap",
            "must be >= per_prompt_cap",
        )
        require(0 <= self.recency_prob <= 1, "recency_prob", "must be in [0, 1]")
        require(self.reward_temperature >= 0, "reward_temperature", "must be >= 0")
        require(self.sync_every >= 1, "sync_every", "must be >= 1")
        require(self.generation_lag >= 0, "generation_lag", "must be >= 0")
        require(self.prefill_batches >= 0, "prefill_batches", "must be >= 0")


@dataclasses.dataclass(kw_only=True, frozen=True)
class VerifyConfig(ConfigBase):
    """How the controller gets verdicts: `controller.verify`. A sample the verifiers could not
    judge (a verifier error, a missed deadline) is sent again up to `retries` times, after
    `retry_backoff_s`, doubling. Still unjudged, it is never trained on: its group is dropped
    (and replaced from the refill stream). More than `max_unjudged_fraction` of a round's
    samples unjudged stops the run. A verifier that does not answer at all is waited for
    instead (controller.component_wait_s): its verdicts, once back, are the same."""

    retries: int = 2  # times an unjudged sample is sent again
    retry_backoff_s: float = 1.0  # seconds before the first retry, doubling after each
    # The share of a round's samples that may stay unjudged before the run stops.
    max_unjudged_fraction: float = 0.1
    # A Verify call's batch deadline: what the service has not judged by then is answered
    # VERIFIER_ERROR (retried).
    deadline_s: float = 600.0

    def validate(self) -> None:
        require(self.retries >= 0, "retries", "must be >= 0")
        require(self.retry_backoff_s >= 0, "retry_backoff_s", "must be >= 0")
        require(
            0 <= self.max_unjudged_fraction <= 1,
            "max_unjudged_fraction",
            "must be in [0, 1] (0: stop at the first sample left unjudged)",
        )
        require(self.deadline_s > 0, "deadline_s", "must be > 0")


@dataclasses.dataclass(kw_only=True, frozen=True)
class EnvironmentConfig(ConfigBase):
    """Multi-turn episodes with tools: `controller.environment` (docs/agents.md). `name` ""
    generates one response per prompt and judges it (single-turn); "tools" runs the
    built-in tool environment (the row's prompt, the policy calls `tools` over several
    turns, then answers; the verifier judges the answer); "module:factory" or
    "path/to/file.py:factory" is an environment of your own ((row, EpisodeLimits) ->
    Environment). Each turn ends at the chat template's end-of-turn token; the tool calls
    are parsed from the turn's text in `tool_format` ("auto": from the chat template), run,
    and their results rendered once by the template and appended as tokens."""

    # "" = single-turn; "tools" = the built-in tool environment; or "module:factory".
    name: str = ""
    # Built-in ("calculator"; "python", run in the verifier's sandbox) or "module:function".
    tools: tuple[str, ...] = ("calculator",)
    max_turns: int = 4  # policy turns per episode, the final answer's included
    # Tokens an episode's response may hold (policy and observation tokens); 0 = the
    # response limit, inference.max_new_tokens.
    max_total_tokens: int = 0
    tool_timeout_s: float = 10.0  # per call, unless the tool sets its own
    # A failed call ("error", "timeout", bad arguments, unknown tool, unparsable call): the
    # policy reads the error and goes on, or the episode ends.
    on_tool_error: Literal["continue", "end"] = "continue"
    # How turns call tools: "hermes" (<tool_call> JSON: Qwen2.5/Qwen3), "llama3"
    # (<|python_tag|> / JSON), "auto" = from the chat template.
    tool_format: Literal["auto", "hermes", "llama3"] = "auto"
    # Refuse to start when the chat template does not render an episode turn by turn as it
    # renders it whole (TurnRenderer.check_prefix_preserving): the trajectories are right
    # either way (never re-tokenised), but the model would meet other tokens when served.
    require_prefix_preserving: bool = True

    def validate(self) -> None:
        require(self.max_turns >= 1, "max_turns", "must be >= 1")
        require(self.max_total_tokens >= 0, "max_total_tokens", "must be >= 0 (0: the limit)")
        require(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0 seconds")
        for spec in self.tools:
            require(bool(spec.strip()), "tools", "names must be non-empty")

    @property
    def enabled(self) -> bool:
        return bool(self.name)


@dataclasses.dataclass(kw_only=True, frozen=True)
class ControllerConfig(ConfigBase):
    # RL train steps of the run
    num_steps: int = 10
    # prompts per train step (× samples_per_prompt = the global batch)
    prompts_per_batch: int = 4
    samples_per_prompt: int = 2  # G: responses per prompt (the group of GRPO)
    datasets: tuple[DatasetConfig, ...] = ()
    # Snapshots are written at every weight-reload boundary (every η steps).
    keep_snapshots: int = 3
    # Prompts longer than inference.max_prompt_len (under the tokenizer and chat template),
    # found when the datasets are scanned at the start: "error" refuses to start and names
    # them and the --set that fits them; "drop" leaves them out of the datasets (counted:
    # metrics dataset/overlong_dropped). Never truncated.
    overlong_prompts: Literal["error", "drop"] = "error"
    # Held-out greedy accuracy: "" = none, else a dataset file (or a built-in task's name),
    # read with the first training dataset's field mapping and template, its first eval_size
    # rows, measured at step 0, every eval_every steps (0 = only at the start and the end)
    # and at the end; at step s workers measure the newest version
    # they may load (s - s % reload_every), which metrics.jsonl names as eval_version.
    eval_dataset: str = ""
    # held-out prompts of each evaluation (see eval_dataset)
    eval_size: int = 64
    # evaluate every this many steps (see eval_dataset)
    eval_every: int = 0
    # The most of the held-out prompts that may also be training prompts (exactly, or after
    # normalising whitespace and case), checked before anything runs: over it the run, eval
    # or prefilter stops and names the datasets. 0: held out means held out.
    max_eval_overlap: float = 0.0
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    replay: ReplayConfig = ReplayConfig()
    verify: VerifyConfig = VerifyConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    # Elastic recovery (docs/controller.md): a lost inference worker, verifier or parameter
    # server costs a wait, not a restart. Its work goes to the others, and every caller
    # waits up to component_wait_s for it (or a replacement) to answer again before the run
    # stops (then `rlax-tpu resume`). The local launcher restarts such a process at most
    # component_restarts times (on its port); a lost trainer or controller stops the job.
    # On GKE it is each crashed pod's backoffLimit (a preempted pod is replaced for free),
    # the controller's included (docs/deploy.md, "What restarts what").
    component_wait_s: float = 300.0
    # how often a lost component is restarted (see component_wait_s)
    component_restarts: int = 3
    # Liveness, not only reachability (docs/controller.md): while a Load, Generate or Verify
    # call runs, its component's health service is asked every few seconds; one that has
    # not answered for liveness_timeout_s (frozen, hung) is lost as if it had died: its
    # work moves to the others and its late answers are ignored. 0 = off (only a component
    # that refuses connections is lost). A Generate is also lost past its deadline: this
    # plus, for each wave of inference.max_decode_slots requests, max_new_tokens decode
    # steps at decode_step_deadline_s each (the worker's compile time not counted; 0 = no
    # deadline). A Verify call's batch deadline is verify.deadline_s.
    liveness_timeout_s: float = 60.0
    # Seconds each decode step of a Generate call may take before the call is lost (its
    # deadline: see liveness_timeout_s; 0 = no deadline).
    decode_step_deadline_s: float = 1.0

    def validate(self) -> None:
        require(self.num_steps >= 1, "num_steps", "must be >= 1")
        require(self.eval_size >= 1, "eval_size", "must be >= 1")
        require(self.eval_every >= 0, "eval_every", "must be >= 0 (0 = start and end only)")
        require(
            0.0 <= self.max_eval_overlap <= 1.0,
            "max_eval_overlap",
            f"must be a fraction in [0, 1], got {self.max_eval_overlap}",
        )
        for name in ("liveness_timeout_s", "decode_step_deadline_s"):
            require(getattr(self, name) >= 0, name, "must be >= 0 (0 = off)")
        require(self.prompts_per_batch >= 1, "prompts_per_batch", "must be >= 1")
        require(self.samples_per_prompt >= 1, "samples_per_prompt", "must be >= 1")
        require(self.keep_snapshots >= 1, "keep_snapshots", "must be >= 1")
        require(self.component_wait_s >= 0, "component_wait_s", "must be >= 0 (0: no wait)")
        require(self.component_restarts >= 0, "component_restarts", "must be >= 0")

    @property
    def global_batch_size(self) -> int:
        """Sequences per train step: prompts_per_batch × samples_per_prompt."""
        return self.prompts_per_batch * self.samples_per_prompt


@dataclasses.dataclass(kw_only=True, frozen=True)
class StorageConfig(ConfigBase):
    # Root of everything a run persists (checkpoints, snapshots, rollout log, params):
    # a local directory or gs://bucket/path.
    run_dir: str = "runs/default"

    def validate(self) -> None:
        require(bool(self.run_dir), "run_dir", "must name a directory or gs:// URL")
        if "://" in self.run_dir:
            scheme = self.run_dir.split("://", 1)[0]
            require(
                scheme in ("gs", "file"),
                "run_dir",
                f"scheme {scheme!r} is not supported; use a local path, file:// or gs://",
            )

    def path(self, *parts: str) -> str:
        return "/".join([self.run_dir.rstrip("/"), *parts])


# A Kubernetes resource quantity: "8", "500m", "32Gi", "1.5".
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


@dataclasses.dataclass(kw_only=True, frozen=True)
class TpuSliceConfig(ConfigBase):
    """One TPU slice on GKE: its node pool's labels and how many chips each host (VM) has.

    The slice has `chips` = the product of the topology and `hosts` = chips / chips_per_host;
    a multi-host slice runs one process per host (one pod each). A multi-slice trainer rents
    `trainer.mesh.num_slices` such slices (the count lives in the mesh alone).
    """

    # Node label cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice, tpu-v6e-slice, ...
    accelerator: str = "tpu-v5p-slice"
    # Node label cloud.google.com/gke-tpu-topology: chips along each axis ("2x4x4" = 32).
    topology: str = "2x2x1"
    # Chips of one host: each pod's google.com/tpu request (4 on v5p).
    chips_per_host: int = 4

    def validate(self) -> None:
        require(bool(self.accelerator), "accelerator", "must name the GKE TPU accelerator")
        require(
            bool(_TOPOLOGY.match(self.topology)),
            "topology",
            f"must be chips along each axis like 2x2x1 or 2x4x4, got {self.topology!r}",
        )
        require(self.chips_per_host >= 1, "chips_per_host", "must be >= 1")
        require(
            self.chips % self.chips_per_host == 0,
            "chips_per_host",
            f"must divide the slice's {self.chips} chips (topology {self.topology}), "
            f"got {self.chips_per_host}",
        )

    @property
    def chips(self) -> int:
        return topology_chips(self.topology)

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def mesh_topology(self) -> str:
        """This slice as a `MeshConfig.topology` ("tpu-v5p-slice", "2x4x4" -> "v5p:2x4x4");
        "" for an accelerator label not in TPU_ACCELERATORS."""
        chip = TPU_ACCELERATORS.get(self.accelerator)
        return f"{chip}:{self.topology}" if chip else ""


@dataclasses.dataclass(kw_only=True, frozen=True)
class DeployConfig(ConfigBase):
    """Where the components of a run go on a cluster (`rlax-tpu deploy gke`, XManager).

    Local runs ignore it. Replica counts come from the other sections
    (`inference.num_workers`, `param_server.num_replicas`); `rlax-tpu deploy` checks that the
    trainer and inference meshes fill their slices and that the run directory is on gs://.
    """

    # the container image of every pod
    image: str = "rlax-tpu:latest"
    # the Kubernetes namespace of the run
    namespace: str = "default"
    # Kubernetes service account of every pod ("" = the namespace's default); bind it to a
    # Google service account that may read and write the run directory (Workload Identity).
    service_account: str = ""
    # Secret whose key `token` holds the shared auth token (never written in a manifest).
    auth_secret: str = "rlax-tpu-auth"
    trainer_tpu: TpuSliceConfig = TpuSliceConfig()
    # One slice per inference worker.
    inference_tpu: TpuSliceConfig = TpuSliceConfig()
    # Node pool (cloud.google.com/gke-nodepool) of the controller and parameter servers,
    # and of the verifier pool (GKE Sandbox enabled, for gVisor); "" = any CPU node.
    cpu_node_pool: str = ""
    # node pool of the verifier pods (see cpu_node_pool)
    verifier_node_pool: str = ""
    # verifier service pods
    verifier_replicas: int = 1
    # CPU request of the controller pod
    controller_cpu: str = "4"
    # memory request of the controller pod
    controller_memory: str = "16Gi"
    # Memory holds K versions split over the replicas (docs/deploy.md sizes it).
    param_server_cpu: str = "8"
    # memory request of each parameter-server pod (see param_server_cpu)
    param_server_memory: str = "64Gi"
    # CPU request of each verifier pod
    verifier_cpu: str = "8"
    # memory request of each verifier pod
    verifier_memory: str = "32Gi"
    # SIGTERM to SIGKILL: the trainer's last checkpoint and the controller's final snapshot.
    termination_grace_period_s: int = 300
    # Restarts of the whole run (JobSet failurePolicy): after the trainer's loss, or a Job
    # that gave up; other lost pods are replaced alone (controller.component_restarts).
    max_restarts: int = 20

    def validate(self) -> None:
        require(bool(self.image), "image", "must name the container image")
        require(bool(self.namespace), "namespace", "must name a Kubernetes namespace")
        require(bool(self.auth_secret), "auth_secret", "must name the Secret with the token")
        require(self.verifier_replicas >= 1, "verifier_replicas", "must be >= 1")
        for name in (
            "controller_cpu",
            "controller_memory",
            "param_server_cpu",
            "param_server_memory",
            "verifier_cpu",
            "verifier_memory",
        ):
            value = getattr(self, name)
            require(
                bool(_QUANTITY.match(value)),
                name,
                f"must be a Kubernetes quantity like 8, 500m or 32Gi, got {value!r}",
            )
        require(
            self.termination_grace_period_s >= 30,
            "termination_grace_period_s",
            "must be >= 30: the trainer saves a checkpoint after SIGTERM",
        )
        require(self.max_restarts >= 0, "max_restarts", "must be >= 0")


# Fields added after runs were made, with the value that does what runs did before them:
# RunConfig.identity leaves a field out at that value, so those runs keep their digest.
# Paths are written as `rlax-tpu config show --help-fields` writes them: `[]` is every
# section of a tuple (controller.datasets), and an absent section (data = None) has none.
# A field added to DatasetConfig is named once per dataset section.
ADDED_FIELDS: dict[str, Any] = {
    "inference.in_flight_update": "off",
    "inference.tick_tokens": 0,
    "controller.datasets[].sft_field": "",
    "data.sft_field": "",
    "trainer.tokens_per_row": 0,  # padded batches, as every run before packing
    "trainer.share_prefixes": False,  # every sample's prompt its own, as before sharing
    # Sharing a group's prompt pages gives bitwise the rollouts of prefilling each sample:
    # what every run before it generated.
    "inference.share_prompt_pages": True,
    "inference.prefix_cache_entries": 0,
    # No run executed programs for its tools before these existed.
    "verifiers.execute_time_limit_s": 10.0,
    "verifiers.execute_memory_limit_bytes": 512 * 2**20,
    "verifiers.execute_output_limit_bytes": 64 * 2**10,
    # Single-turn runs, as every run was before episodes.
    "controller.environment": EnvironmentConfig().to_dict(),
    "model.lora": None,  # full fine-tuning, as every run before LoRA
    "inference.weight_dtype": "",  # weights served as published, as every run before it
}


def _sections_at(data: dict[str, Any], keys: list[str]) -> list[dict[str, Any]]:
    """The sections of a config's dict form at `keys` (an ADDED_FIELDS path's parents):
    `name[]` steps into every section of a list, and a missing or None section yields
    none."""
    sections = [data]
    for key in keys:
        name, every = (key[:-2], True) if key.endswith("[]") else (key, False)
        found = [s.get(name) for s in sections]
        if every:
            found = [item for items in found if isinstance(items, list | tuple) for item in items]
        sections = [s for s in found if isinstance(s, dict)]
    return sections


def leave_out_added(data: dict[str, Any]) -> dict[str, Any]:
    """A config's dict form (`to_dict`) without the ADDED_FIELDS that hold the value that
    does what configs did before them (in place; returned): what a key or digest of a
    config reads, so configs written before a field existed keep theirs."""
    for dotted, default in ADDED_FIELDS.items():
        *parents, last = dotted.split(".")
        for section in _sections_at(data, parents):
            if section.get(last) == default:
                del section[last]
    return data


# RunConfig.resumable_fields: changing them on resume changes no result.
RESUMABLE_FIELDS = (
    "controller.num_steps",
    "controller.eval_every",
    "controller.eval_size",
    "controller.eval_dataset",
    "controller.max_eval_overlap",
    "controller.keep_snapshots",
    "controller.component_wait_s",  # how long a lost component is waited for, not results
    "controller.component_restarts",
    "controller.liveness_timeout_s",  # when a silent component is given up, not results
    "controller.decode_step_deadline_s",
    "controller.verify.deadline_s",
    "trainer.checkpoint_every",
    "trainer.warm_start.checkpoint_every",
    "trainer.compiled_dir",
    "compilation_cache",  # where compiled programs are kept, not what they compute
    "trainer.max_checkpoints_to_keep",
    "trainer.recompute_every",  # metrics only: the weights never read it
    "trainer.gpu",
    "trainer.gpu_memory_fraction",
    "inference.gpu",
    "inference.gpu_memory_fraction",
    "inference.prefetch_weights",  # when the weights move, not which
    "inference.colocated",  # where the worker runs and how weights reach it, not which
    "inference.colocated_publish",  # which versions the server also gets, not the weights
    "inference.compiled_dir",
    "verifiers.address",
    "deploy",
    "logging",
)


# Fields that moved (issue 39: knobs grouped by what owns them), old path -> new path. Old
# paths still work for one release: `--set OLD=...` and an OLD key in a config dict or JSON
# (an older run's config.json) set the new field with a ConfigRenamedWarning. The digest of
# a run is of its config written with the old paths (RunConfig.identity), so the runs of an
# older version resume.
RENAMED_FIELDS: dict[str, str] = {
    **{
        f"trainer.{name}": f"trainer.optimizer.{name}"
        for name in (
            "learning_rate",
            "lr_schedule",
            "warmup_steps",
            "lr_decay_steps",
            "weight_decay",
            "adam_b1",
            "adam_b2",
            "adam_eps",
            "grad_clip_norm",
        )
    },
    "controller.sft_steps": "trainer.warm_start.steps",
    "controller.sft_learning_rate": "trainer.warm_start.learning_rate",
    "controller.sft_checkpoint_every": "trainer.warm_start.checkpoint_every",
    "controller.dynamic_sampling": "controller.dynamic_sampling.enabled",
    "controller.dynamic_sampling_max_rounds": "controller.dynamic_sampling.max_rounds",
    "controller.replay": "controller.replay.enabled",
    **{
        f"controller.replay_{name}": f"controller.replay.{name}"
        for name in (
            "per_prompt_cap",
            "global_cap",
            "recency_prob",
            "reward_temperature",
            "sync_every",
            "generation_lag",
            "prefill_batches",
        )
    },
    "controller.verify_retries": "controller.verify.retries",
    "controller.verify_retry_backoff_s": "controller.verify.retry_backoff_s",
    "controller.max_unjudged_fraction": "controller.verify.max_unjudged_fraction",
    "controller.verify_deadline_s": "controller.verify.deadline_s",
    # each part's knobs in its section of trainer.algorithm (clip, kl, rollout_is, ...)
    **{
        f"trainer.algorithm.{old}": f"trainer.algorithm.{new}"
        for old, new in RENAMED_ALGORITHM_FIELDS.items()
    },
}


@dataclasses.dataclass(kw_only=True, frozen=True)
class LoggingConfig(ConfigBase):
    """Where the controller's metrics go besides metrics.jsonl and TensorBoard: every row
    also to Weights & Biases when `wandb_project` is set (needs `pip install wandb`; a
    resumed run continues the same W&B run, its id kept in the run directory). Changing
    these on resume changes no result: they are not part of the config digest."""

    wandb_project: str = ""  # "" = no W&B
    wandb_entity: str = ""  # the W&B team or user ("" = the API key's default)
    wandb_run_name: str = ""  # the W&B run's display name ("" = the config's name)
    # "offline" keeps the run on disk (`wandb sync` uploads it later), "disabled" turns every
    # call into a no-op; "" = wandb's own default (online, or $WANDB_MODE).
    wandb_mode: Literal["", "online", "offline", "disabled"] = ""

    @property
    def wandb_enabled(self) -> bool:
        return bool(self.wandb_project)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RunConfig(ConfigBase):
    """Everything a run needs. Built by a `configs/*.py` file's `get_config()`."""

    # the run's name: metrics, manifests, W&B and the trial directory use it
    name: str = "run"
    # seed of everything random in the run (init, prompt streams, sampling)
    seed: int = 0
    # On the CPU platform, how many virtual devices JAX should expose (0 = leave as is).
    cpu_devices: int = 0
    # Compiler flags every process of the run starts JAX with, and `rlax-tpu compile`
    # compiles under (one place: rlax_tpu.runtime.jax_environment): xla_flags go to
    # XLA_FLAGS (every platform), libtpu_flags to LIBTPU_INIT_ARGS (TPU), e.g.
    # "--xla_tpu_enable_latency_hiding_scheduler=true". Part of the run's identity.
    xla_flags: str = ""
    # flags for LIBTPU_INIT_ARGS (TPU), as xla_flags above
    libtpu_flags: str = ""
    # JAX's persistent compilation cache, for every process of the run, so that a restarted
    # component loads its programs instead of compiling them again: "auto" =
    # <run_dir>/compile_cache for a local run directory, else ~/.cache/rlax_tpu/compile_cache;
    # "off"; or a directory (local or gs://). A JAX_COMPILATION_CACHE_DIR already in the
    # environment wins. Changes no result.
    compilation_cache: str = "auto"
    model: ModelConfig = ModelConfig()
    staleness: StalenessConfig = StalenessConfig()
    trainer: TrainerConfig = TrainerConfig()
    inference: InferenceConfig = InferenceConfig()
    param_server: ParamServerConfig = ParamServerConfig()
    verifiers: VerifierConfig = VerifierConfig()
    controller: ControllerConfig = ControllerConfig()
    # The training dataset (docs/datasets.md); controller.datasets adds more, weighted, to
    # the prompt mixture (`training_datasets`: this one first).
    data: DatasetConfig | None = None
    storage: StorageConfig = StorageConfig()
    deploy: DeployConfig = DeployConfig()
    logging: LoggingConfig = LoggingConfig()

    RENAMED = RENAMED_FIELDS

    def validate(self) -> None:
        require(self.cpu_devices >= 0, "cpu_devices", "must be >= 0")
        inference, seq = self.inference, self.trainer.max_seq_len
        require(
            inference.max_prompt_len + inference.max_new_tokens <= seq,
            "trainer.max_seq_len",
            f"{seq} cannot hold a prompt of inference.max_prompt_len "
            f"({inference.max_prompt_len}) and a response of inference.max_new_tokens "
            f"({inference.max_new_tokens}): the trainer would train on cut sequences while "
            f"the reward judged the whole response. Set trainer.max_seq_len="
            f"{inference.max_prompt_len + inference.max_new_tokens} or lower those limits",
        )
        require(
            inference.in_flight_update == "off" or self.staleness.schedule == "deterministic",
            "inference.in_flight_update",
            f'{inference.in_flight_update!r} needs staleness.schedule = "deterministic": a '
            "response moves to the next version at a tick the schedule fixes, and the "
            '"freshest" schedule picks versions by timing',
        )
        require(
            not self.controller.environment.enabled or inference.in_flight_update == "off",
            "controller.environment",
            'multi-turn episodes run with inference.in_flight_update = "off" for now (an '
            "episode's turns are generated with its batch's version)",
        )
        require(
            self.controller.environment.max_total_tokens <= inference.max_new_tokens,
            "controller.environment.max_total_tokens",
            f"an episode's response is one response: at most inference.max_new_tokens "
            f"({inference.max_new_tokens}) tokens; lower it, or 0 for that limit",
        )
        global_batch = self.controller.global_batch_size
        require(
            global_batch % self.trainer.mini_batch_size == 0,
            "trainer.mini_batch_size",
            f"must divide the global batch (controller.prompts_per_batch × "
            f"controller.samples_per_prompt = {global_batch}), got {self.trainer.mini_batch_size}",
        )
        hot = self.param_server.hot_versions
        need = self.staleness.max_staleness // self.staleness.reload_every + 1
        require(
            hot is None or hot >= need,
            "param_server.hot_versions",
            f"K={hot} cannot hold every published version a batch may still need: need "
            f"K >= N // η + 1 = {need} (workers load only multiples of η)",
        )
        require(
            self.inference.max_prompt_len + self.inference.max_new_tokens
            <= self.model.max_position_embeddings,
            "inference.max_new_tokens",
            f"max_prompt_len + max_new_tokens exceeds model.max_position_embeddings "
            f"({self.model.max_position_embeddings})",
        )
        for section, slice_field in (("trainer", "trainer_tpu"), ("inference", "inference_tpu")):
            topology = getattr(self, section).mesh.topology
            tpu = getattr(self.deploy, slice_field)
            require(
                not topology or topology == tpu.mesh_topology,
                f"{section}.mesh.topology",
                f"{topology!r} disagrees with deploy.{slice_field} (accelerator "
                f"{tpu.accelerator!r}, topology {tpu.topology!r}"
                + (f" = {tpu.mesh_topology}" if tpu.mesh_topology else ", an unknown chip")
                + f"): `rlax-tpu compile` would prove a slice the deployment does not rent. "
                f"Make them name the same slice: set deploy.{slice_field}.accelerator and "
                f'.topology, or {section}.mesh.topology ("" follows deploy.{slice_field}); '
                f"to change both with --set, clear {section}.mesh.topology first "
                f"(--set {section}.mesh.topology= --set deploy.{slice_field}.topology=...)",
            )
        algorithm = self.trainer.algorithm.resolved()
        if algorithm.is_policy_gradient:
            # GAE's baseline V_old and the value loss both read the model's value head.
            reads_values = algorithm.advantage == "gae" or algorithm.value.loss_coef > 0
            require(
                self.model.value_head or not reads_values,
                "model.value_head",
                f"trainer.algorithm {algorithm.name!r} has trainer.algorithm.advantage="
                f"{algorithm.advantage!r} and trainer.algorithm.value.loss_coef="
                f"{algorithm.value.loss_coef}, which need a value head: set "
                "model.value_head=true (with --set, before trainer.algorithm), or use an "
                "advantage without a critic (e.g. trainer.algorithm.advantage=group_mean "
                "and trainer.algorithm.value.loss_coef=0)",
            )

        require(
            not (self.controller.replay.enabled and greedy_baseline(algorithm)),
            "controller.replay.enabled",
            "cannot go with trainer.algorithm.advantage='remax': ReMax's baseline is the reward "
            "of each prompt's greedy response under the batch's version, and the replay buffer "
            "trains on rollouts of older batches; set controller.replay.enabled=false or pick "
            "another advantage",
        )
        # A rollout correction weighs π_old / π_rollout: π_old must be the trainer's recompute.
        require(
            self.trainer.behaviour_logprobs == "recomputed"
            or not needs_rollout_logprobs(algorithm),
            "trainer.behaviour_logprobs",
            rollout_correction_conflict(algorithm),
        )

    def tpu_topology(self, component: Literal["trainer", "inference"]) -> str:
        """The TPU slice `component`'s mesh runs on ("v5p:2x4x4"): its mesh's topology, else
        its deploy slice's ("" when that accelerator is unknown)."""
        mesh = getattr(self, component).mesh
        return mesh.topology or getattr(self.deploy, f"{component}_tpu").mesh_topology

    @property
    def hot_versions(self) -> int:
        """K: versions the parameter server keeps in memory (default N // η + 2, the
        published versions a run may read at once plus a spare: StalenessPolicy)."""
        if self.param_server.hot_versions is not None:
            return self.param_server.hot_versions
        return self.staleness.max_staleness // self.staleness.reload_every + 2

    @property
    def training_datasets(self) -> tuple[DatasetConfig, ...]:
        """The prompt mixture's datasets: `data` (when set), then controller.datasets."""
        return ((self.data,) if self.data is not None else ()) + self.controller.datasets

    def resumable_fields(self) -> tuple[str, ...]:
        """The dotted fields (or whole sections) a run may change when it is resumed: how
        long it runs, how it is evaluated, checkpointed, snapshotted, logged and deployed,
        never what it computes. controller.num_steps is one unless it is the horizon of the
        learning-rate decay (trainer.optimizer.lr_schedule cosine/linear with lr_decay_steps
        0)."""
        fields = RESUMABLE_FIELDS
        optimizer = self.trainer.optimizer
        if optimizer.lr_schedule != "constant" and not optimizer.lr_decay_steps:
            fields = tuple(f for f in fields if f != "controller.num_steps")
        return fields

    def identity(self) -> dict[str, Any]:
        """The config without its resumable fields: what decides the run's results. A mesh
        on one slice leaves out its multi-slice fields (num_slices 1, and dcn_axis, which
        then places nothing), fields added since runs existed are left out at the value that
        does what runs did before them (ADDED_FIELDS), and moved fields are written at their
        old paths (RENAMED_FIELDS): a config written before any of these keeps its digest."""
        data = self.to_dict()
        for dotted in self.resumable_fields():
            *parents, last = dotted.split(".")
            section = data
            for key in parents:
                section = section.get(key) or {}
            section.pop(last, None)
        for component in ("trainer", "inference"):
            mesh = data[component]["mesh"]
            if mesh["num_slices"] == 1:
                del mesh["num_slices"], mesh["dcn_axis"]
        return unmove_renamed(leave_out_added(data), RENAMED_FIELDS)

    def digest(self) -> str:
        """sha256 of the canonical JSON form of `identity()`: the identity of this run.
        Configs that differ only in resumable fields share it, so a finished run can be
        extended (more num_steps) and a resumed one evaluated or deployed differently."""
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
