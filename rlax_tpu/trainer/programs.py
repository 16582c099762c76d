"""The trainer's jitted programs and the layouts they run on, built once from (config, mesh).

`Trainer` runs them on real arrays; `rlax-tpu compile` (rlax_tpu.compile) lowers the same
programs on abstract arrays of a TPU topology to measure their memory and FLOPs without the
hardware. One builder, so what is compiled there is what runs here. Nothing here allocates
device memory: parameters and optimizer states are `jax.ShapeDtypeStruct`s carrying their
shardings until `random_init` / `init_opt` run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu.algorithms import RolloutBatch, build_objective
from rlax_tpu.config import ConfigError, RunConfig
from rlax_tpu.models import Transformer, lora
from rlax_tpu.models.options import ForwardOptions
from rlax_tpu.models.transformer import unstack_layers
from rlax_tpu.sharding import logical_to_spec, state_shardings
from rlax_tpu.trainer.packing import (
    PackedLayout,
    packed_layout,
    response_starts,
    sequence_lengths,
)
from rlax_tpu.trainer.step import (
    BatchLevels,
    Optimizer,
    build_optimizer,
    count_params,
    make_rl_step,
    make_sft_step,
    mismatch_metrics,
    policy_temperature,
    recompute,
    trainable_parts,
)

# RolloutBatch's optional fields the trainer computes itself before the update (π_ref, V_old,
# and π_rollout: the cached behaviour log-probs kept next to the recomputed π_old) ...
COMPUTED_FIELDS = ("reference_logprobs", "values", "rollout_logprobs")
# ... and those only the sender can supply (api.trainer.RolloutArrays, TrainStep's stream).
SENT_FIELDS = ("token_rewards", "token_advantages", "returns", "baseline_rewards")
_NEEDS_FLAG = {"values": "needs_rollout_values"}  # else the objective's needs_<field>


def cast_floats(tree: Any, dtype: jnp.dtype) -> Any:
    """Every floating leaf of `tree` cast to `dtype` (round to nearest even); an elementwise
    op, so under jit each output keeps its input's sharding."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def objective_inputs(objective: Any) -> frozenset[str]:
    """The optional `RolloutBatch` fields `objective` cannot do without: π_ref, V_old and
    π_rollout by its flags (`needs_reference_logprobs`, `needs_rollout_values`,
    `needs_rollout_logprobs`), and of the sent ones those its parts require —
    token_advantages for advantage="given", baseline_rewards for "remax", returns for a
    value loss without GAE — or that a flag `needs_<field>` asks for. (token_rewards, and
    returns next to GAE, are read when a batch brings them, never required.)"""
    names = {
        name
        for name in COMPUTED_FIELDS
        if getattr(objective, _NEEDS_FLAG.get(name, f"needs_{name}"))
    }
    names |= {name for name in SENT_FIELDS if getattr(objective, f"needs_{name}", False)}
    c = objective.config
    if c.is_policy_gradient:
        if c.advantage == "given":
            names.add("token_advantages")
        if c.advantage == "remax":
            names.add("baseline_rewards")
        if c.value.loss_coef > 0 and c.advantage != "gae":
            names.add("returns")
    return frozenset(names)


def train_model(config: RunConfig, rngs: nnx.Rngs) -> Transformer:
    """The model as the trainer holds it (decoder layers stacked with trainer.scan_layers)."""
    if config.trainer.scan_layers:
        return Transformer(config.model, rngs=rngs, scan_layers=True)
    return Transformer(config.model, rngs=rngs)


@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerLayout:
    """An optimizer (with its learning-rate schedule), and its state's shardings and
    abstract value (sharded like the params each entry tracks; counts and schedules
    replicated)."""

    optimizer: Optimizer
    shardings: Any
    abstract: Any
    split: Any  # params -> (what it trains, what stays frozen): `trainable_parts`


class TrainerPrograms:
    """Model layout, optimizers and jitted functions of a trainer over `mesh`.

    Attributes: levels, objective, inputs (the optional batch fields the objective reads:
    `objective_inputs`), temperature, forward_options (resolved for the mesh's platform),
    graphdef, param_shardings, abstract_params, num_params, rl / sft (`OptimizerLayout`s of
    the RL optimizer and of the SFT warm start's), and the jitted functions:

      recompute(params, tokens, values: static bool[, layout]) -> Recomputed   (π_old, V_old)
      rl_step(params, opt_state, batch, step, behaviour[, layout]) -> (params, opt_state, metrics)
      sft_step(params, opt_state, tokens, targets, loss_mask[, layout]) -> (params, opt_state,
          metrics)
      init_opt(params), init_sft_opt(params), mismatch(recomputed, cached, mask),
      random_init() -> params

    rl_step and sft_step donate params and optimizer state (updated in place); with
    inference.colocated, rl_step donates the optimizer state only: the params of the last
    version are also the co-located worker's weights (the trainer hands them over, no copy),
    and the step writes the new ones beside them. With
    trainer.tokens_per_row > 0 (`tokens_per_row`) the recompute and the steps take the
    batch's packed `layout` (`layout(mask, chunks=...)`, placed by `layout_shardings`) and
    run packed rows.
    """

    def __init__(self, config: RunConfig, mesh: Mesh) -> None:
        self.config = config
        self.mesh = mesh
        self.rules = config.trainer.mesh.logical_axis_rules
        self.levels = BatchLevels.from_config(config)
        # Packed batches (issue 42): > 0 packs each chunk's sequences into rows of this many
        # tokens; 0 runs the padded rows.
        self.tokens_per_row = config.trainer.tokens_per_row
        # Shared prompts (trainer.share_prefixes): the RL programs' packed rows hold each
        # prompt its samples share once; SFT's do not.
        self.share_prefixes = bool(self.tokens_per_row) and config.trainer.share_prefixes
        self.objective = build_objective(config.trainer.algorithm)
        self.inputs = objective_inputs(self.objective)  # optional batch fields it reads
        # π_θ, π_old and the reference at the rollouts' sampling temperature (greedy: 1),
        # the distribution the inference workers' behaviour log-probs are of; SFT at 1.
        self.temperature = policy_temperature(config.inference)
        # Remat, attention kernel and log-prob chunking of every training forward, resolved
        # for the mesh's platform (TPU for abstract TPU devices on any host).
        self.platform = mesh.devices.flat[0].platform
        self.forward_options = ForwardOptions.from_trainer(config.trainer, platform=self.platform)
        if self.share_prefixes and self.forward_options.attention == "splash":
            raise ConfigError(
                f"attention_backend=auto runs splash attention on {self.platform}, whose masks "
                "cannot attend to a shared prompt's segment; set trainer.attention_backend=jax, "
                "or trainer.share_prefixes=false",
                field="trainer.share_prefixes",
            )

        abstract_model = nnx.eval_shape(lambda: train_model(config, nnx.Rngs(0)))
        self.graphdef, abstract_state = nnx.split(abstract_model, nnx.Param)
        self.param_shardings = nnx.to_pure_dict(state_shardings(abstract_state, mesh, self.rules))
        self.abstract_params = jax.tree.map(
            lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
            nnx.to_pure_dict(abstract_state),
            self.param_shardings,
        )
        self.num_params = count_params(self.abstract_params)
        # LoRA (model.lora): RL trains the adapters only, on a frozen base; an SFT warm start
        # trains the base (the adapters, still the identity, wait for RL). `split_trainable`
        # cuts RL's trainable part out of a params tree (`trainable_parts`).
        self.lora = config.model.lora is not None
        self.trainable = "adapters" if self.lora else "all"
        self.sft_trainable = "base" if self.lora else "all"
        self.split_trainable, self.join_trainable = trainable_parts(self.trainable)
        self.abstract_trainable = self.split_trainable(self.abstract_params)[0]
        self.num_trainable = count_params(self.abstract_trainable)

        ctl, warm, updates = config.controller, config.trainer.warm_start, self.levels.num_updates
        optimizer = config.trainer.optimizer
        self.rl = self._optimizer_layout(
            build_optimizer(
                optimizer,
                num_steps=optimizer.lr_decay_steps or ctl.num_steps,
                updates_per_step=updates,
            ),
            self.trainable,
        )
        # The SFT warm start's own optimizer: its learning rate, a schedule over its steps.
        self.sft = self._optimizer_layout(
            build_optimizer(
                warm.optimizer(optimizer),
                num_steps=max(warm.steps, 1),
                updates_per_step=updates,
            ),
            self.sft_trainable,
        )
        self._build_functions()

    def _optimizer_layout(self, optimizer: Optimizer, trainable: str) -> OptimizerLayout:
        split = trainable_parts(trainable)[0]
        abstract = jax.eval_shape(optimizer.transform.init, split(self.abstract_params)[0])
        shardings = optax.tree_map_params(
            optimizer.transform,
            lambda _, s: s,
            abstract,
            split(self.param_shardings)[0],
            transform_non_params=lambda _: self.replicated,
        )
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
        )
        return OptimizerLayout(optimizer, shardings, abstract, split)

    def _build_functions(self) -> None:
        p_sh = self.param_shardings
        # Metrics replicated: every process of a multi-host mesh can read them.
        replicated = self.replicated
        rl, sft = self.rl, self.sft
        self.init_opt = jax.jit(
            lambda p: rl.optimizer.transform.init(rl.split(p)[0]), out_shardings=rl.shardings
        )
        self.init_sft_opt = jax.jit(
            lambda p: sft.optimizer.transform.init(sft.split(p)[0]), out_shardings=sft.shardings
        )
        graphdef, levels, options = self.graphdef, self.levels, self.forward_options
        temperature, packed = self.temperature, self.tokens_per_row > 0
        self.recompute = jax.jit(
            lambda params, tokens, values, layout=None: recompute(
                graphdef,
                params,
                tokens,
                micro_size=levels.micro_size,
                values=values,
                temperature=temperature,
                options=options,
                layout=layout,
            ),
            static_argnums=2,
        )
        self.rl_step = jax.jit(
            make_rl_step(
                graphdef,
                self.objective,
                self.rl.optimizer,
                levels,
                temperature=temperature,
                options=options,
                packed=packed,
                trainable=self.trainable,
            ),
            # Co-located, the params in stay valid: they are the worker's weights until it loads
            # the new version (Trainer._publish).
            donate_argnums=(1,) if self.config.inference.colocated else (0, 1),
            out_shardings=(p_sh, self.rl.shardings, replicated),
        )
        self.sft_step = jax.jit(
            make_sft_step(
                graphdef,
                self.sft.optimizer,
                levels,
                options=options,
                packed=packed,
                trainable=self.sft_trainable,
            ),
            donate_argnums=(0, 1),
            out_shardings=(p_sh, self.sft.shardings, replicated),
        )
        self.mismatch = jax.jit(mismatch_metrics, out_shardings=replicated)
        config, seed = self.config, self.config.seed
        self.random_init = jax.jit(
            lambda: nnx.to_pure_dict(nnx.state(train_model(config, nnx.Rngs(seed)), nnx.Param)),
            out_shardings=p_sh,
        )
        # The params as the inference workers serve them (cast to model.publish_dtype, per
        # layer when the trainer scans stacked layers); None when they are the params as is.
        # With LoRA the adapters alone, packed in one array (`publish`, models.lora.pack), and,
        # once, the frozen base (`publish_base`).
        dtype = jnp.dtype(config.model.published_dtype)
        unchanged = not config.trainer.scan_layers and all(
            x.dtype == dtype for x in jax.tree.leaves(self.abstract_params)
        )
        served = lambda p: cast_floats(unstack_layers(p), dtype)  # noqa: E731
        self.publish_base = None
        if self.lora:
            self.publish = jax.jit(
                lambda p: lora.pack(served(self.split_trainable(p)[0])),
                out_shardings=self.replicated,
            )
            self.publish_base = jax.jit(lambda p: served(self.split_trainable(p)[1]))
        else:
            self.publish = None if unchanged else jax.jit(served)

    # -- placement -----------------------------------------------------------------------
    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def sharding(self, logical: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        spec = logical_to_spec(logical, self.rules, shape=shape, mesh=self.mesh)
        return NamedSharding(self.mesh, spec)

    def row_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        """A batch array with rows first (and sequence second): rows over the batch axes."""
        return self.sharding(("batch", "length")[: len(shape)], shape)

    # -- packed layouts (trainer.tokens_per_row > 0) ----------------------------------------
    def layout(self, mask: Any, *, chunks: int, tokens: Any = None) -> PackedLayout:
        """The host `PackedLayout` of a global batch whose loss / response mask is `mask`
        (bool|float[G, T]) split into `chunks` chunks: the mini-batches of a train step
        (`levels.num_updates`), or 1 for the recompute. With `tokens` (an RL batch's) and
        trainer.share_prefixes, the rows of a chunk sharing a prompt hold it once. A
        function of the mask (and the tokens), so a resumed step packs as the uninterrupted
        one did."""
        mask = np.asarray(mask)
        shared = {}
        if self.share_prefixes and tokens is not None:
            shared = dict(starts=response_starts(mask), tokens=np.asarray(tokens))
        return packed_layout(
            sequence_lengths(mask),
            chunks=chunks,
            micro_size=self.levels.micro_size,
            tokens_per_row=self.tokens_per_row,
            seq=mask.shape[1],
            **shared,
        )

    def layout_shardings(self, layout: PackedLayout) -> PackedLayout:
        """Where a layout's arrays go: packed rows (and the unpack index's padded rows) over
        the batch axes, as the micro-batches they index (the leading chunk and micro-batch
        axes, scanned over, are not sharded); the used counts replicated. `layout` may hold
        arrays or shapes."""
        packed = (None, None, "batch", "length")
        prefix_ids = layout.prefix_ids
        return PackedLayout(
            *(self.sharding(packed, np.shape(x)) for x in layout[:3]),
            unpack=self.sharding((None, "batch", "length"), np.shape(layout.unpack)),
            used=self.replicated,
            prefix_ids=None if prefix_ids is None else self.sharding(packed, np.shape(prefix_ids)),
        )

    def abstract_layout(self, chunks: int, seq_len: int, *, shared: bool = False) -> PackedLayout:
        """A `PackedLayout` of the global batch of `seq_len` tokens in `chunks` chunks, as
        abstract arrays placed as `Trainer` places one; `shared`: with prefix_ids (an RL
        program's layout under trainer.share_prefixes)."""
        rows = self.levels.global_size // chunks
        micro = self.levels.micro_size
        packed = (chunks, rows // micro, micro, self.tokens_per_row)
        shapes = (packed, packed, packed, (chunks, rows, seq_len), (chunks,))
        shapes += (packed,) if shared and self.share_prefixes else ()
        layout = PackedLayout(*(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes))
        return jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            layout,
            self.layout_shardings(layout),
        )

    # -- abstract inputs (rlax-tpu compile) ------------------------------------------------
    def abstract_rows(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=self.row_sharding(shape))

    def abstract_tokens(self, seq_len: int) -> jax.ShapeDtypeStruct:
        """int32[global batch, seq_len], placed as `Trainer` places a batch's tokens."""
        return self.abstract_rows((self.levels.global_size, seq_len), jnp.int32)

    def abstract_rollout_batch(self, seq_len: int) -> RolloutBatch:
        """A global batch as `train_step` hands it to `rl_step`: the fields the controller
        sends (api.trainer.RolloutArrays) plus the optional ones the objective reads
        (`inputs`: π_ref, V_old, π_rollout computed by the trainer; dense rewards, given
        advantages and returns, baselines sent with the batch), each placed by rows."""
        rows, seq = self.levels.global_size, seq_len
        per_token = self.abstract_rows((rows, seq), jnp.float32)
        per_row = self.abstract_rows((rows,), jnp.float32)
        optional = {
            name: (per_row if name == "baseline_rewards" else per_token) for name in self.inputs
        }
        return RolloutBatch(
            tokens=self.abstract_tokens(seq),
            response_mask=self.abstract_rows((rows, seq), jnp.bool_),
            group_ids=self.abstract_rows((rows,), jnp.int32),
            rewards=per_row,
            behaviour_logprobs=per_token,
            versions=self.abstract_rows((rows,), jnp.int32),
            **optional,
        )

    def abstract_rl_step_args(self, seq_len: int) -> tuple:
        """(params, opt_state, batch, step, behaviour) of one `rl_step` call."""
        per_token = self.abstract_rows((self.levels.global_size, seq_len), jnp.float32)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        behaviour = {"recomputed": per_token, "cached": per_token}
        batch = self.abstract_rollout_batch(seq_len)
        args = (self.abstract_params, self.rl.abstract, batch, step, behaviour)
        if self.tokens_per_row:
            args += (self.abstract_layout(self.levels.num_updates, seq_len, shared=True),)
        return args

    def lowerings(self) -> dict[str, tuple[Any, tuple, tuple[int, ...]]]:
        """The programs `rlax-tpu compile` compiles and `trainer.compiled_dir` can replace:
        name -> (jitted function, abstract arguments at the compiled shapes (the global batch
        of trainer.max_seq_len tokens), indices of its static arguments)."""
        seq = self.config.trainer.max_seq_len
        values = self.objective.needs_rollout_values
        warm_start = self.config.trainer.warm_start.steps > 0
        table = {
            "init": (self.random_init, (), ()),
            "init_opt": (self.init_opt, (self.abstract_params,), ()),
            "rl_step": (self.rl_step, self.abstract_rl_step_args(seq), ()),
            "recompute": (
                self.recompute,
                (self.abstract_params, self.abstract_tokens(seq), values)
                + ((self.abstract_layout(1, seq, shared=True),) if self.tokens_per_row else ()),
                (2,),
            ),
        }
        if warm_start:
            table["init_sft_opt"] = (self.init_sft_opt, (self.abstract_params,), ())
            table["sft_step"] = (self.sft_step, self.abstract_sft_step_args(seq), ())
        if self.publish is not None:
            table["publish"] = (self.publish, (self.abstract_params,), ())
        return table

    def use_saved_executables(self, directory: str) -> list[str]:
        """Replace each program `directory` holds a saved executable of (rlax-tpu compile
        --save-compiled) by it, for calls at the shapes it was compiled for; returns their
        names. CompiledMismatchError when one was compiled for another program or mesh."""
        from rlax_tpu.compile import executables
        from rlax_tpu.compile.executables import SavedProgram
        from rlax_tpu.sharding import use_mesh

        loaded = []
        for name, (jitted, args, static) in self.lowerings().items():
            with use_mesh(self.mesh, self.rules):
                lowered = jitted.lower(*args)
            executable = executables.load(directory, name, lowered, self.mesh)
            if executable is not None:
                attribute = "random_init" if name == "init" else name
                setattr(self, attribute, SavedProgram(executable, jitted, args, static))
                loaded.append(name)
        return loaded

    def abstract_sft_step_args(self, seq_len: int) -> tuple:
        """(params, opt_state, tokens, targets, loss_mask) of one `sft_step` call."""
        shape = (self.levels.global_size, seq_len)
        tokens = self.abstract_rows(shape, jnp.int32)
        mask = self.abstract_rows(shape, jnp.float32)
        args = (self.abstract_params, self.sft.abstract, tokens, tokens, mask)
        if self.tokens_per_row:
            args += (self.abstract_layout(self.levels.num_updates, seq_len),)
        return args
