"""The pure, jitted core of the trainer: batch levels, the optimizer, the log-prob
recompute and the RL / SFT update over one global batch.

Everything here is a function of (params, optimizer state, batch, step); the `Trainer`
class owns the state, the mesh, versions and checkpoints and calls these under
`use_mesh`. With trainer.tokens_per_row > 0 the steps and the recompute run packed rows
(issue 42; `packing.PackedLayout`, passed next to the padded batch) and read the padded
layout everywhere else. Shapes: G = global batch, T = sequence length, V = vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rlax_tpu.algorithms import Objective, RolloutBatch
from rlax_tpu.algorithms.metrics import masked_mean, masked_quantile
from rlax_tpu.config import InferenceConfig, OptimizerConfig, RunConfig
from rlax_tpu.models import lora as lora_lib
from rlax_tpu.models.options import REFERENCE, ForwardOptions
from rlax_tpu.sharding import constrain
from rlax_tpu.trainer.packing import PackedLayout

Params = Any  # a pure dict of arrays (nnx.to_pure_dict of the model's nnx.Param state)
Metrics = dict[str, jax.Array]


class BatchSizeError(ValueError):
    """A batch whose shape does not fit the configured batch levels; says what was expected."""


@dataclasses.dataclass(frozen=True)
class BatchLevels:
    """The three batch levels, derived from the config and never repeated.

    global_size: sequences per train step (controller.prompts_per_batch × samples_per_prompt);
    mini_size: sequences per optimizer update, so a step makes `num_updates` updates;
    micro_size: sequences per forward/backward pass, so an update accumulates gradients
    over `micro_per_mini` passes.
    """

    global_size: int
    mini_size: int
    micro_size: int

    @classmethod
    def from_config(cls, config: RunConfig) -> BatchLevels:
        return cls(
            global_size=config.controller.global_batch_size,
            mini_size=config.trainer.mini_batch_size,
            micro_size=config.trainer.micro_batch_size,
        )

    def __post_init__(self) -> None:
        if self.global_size % self.mini_size or self.mini_size % self.micro_size:
            raise BatchSizeError(
                f"batch levels must nest: micro ({self.micro_size}) | mini ({self.mini_size}) "
                f"| global ({self.global_size})"
            )

    @property
    def num_updates(self) -> int:
        return self.global_size // self.mini_size

    @property
    def micro_per_mini(self) -> int:
        return self.mini_size // self.micro_size

    def check(self, rows: int, seq: int, max_seq_len: int) -> None:
        if rows != self.global_size:
            raise BatchSizeError(
                f"the batch has {rows} sequences but a train step takes exactly the global "
                f"batch of {self.global_size} (controller.prompts_per_batch × "
                "controller.samples_per_prompt); pad or fill the batch"
            )
        if seq > max_seq_len:
            raise BatchSizeError(
                f"the batch has sequence length {seq} > trainer.max_seq_len ({max_seq_len})"
            )


# -- optimizer -----------------------------------------------------------------------------


def learning_rate_schedule(
    optimizer: OptimizerConfig, *, num_steps: int, updates_per_step: int
) -> optax.Schedule:
    """The learning rate as a function of the optimizer-update count.

    Warmup and decay are counted in train steps (`warmup_steps`, and `num_steps`:
    trainer.optimizer.lr_decay_steps, else controller.num_steps), so
    every update within one step uses the same rate: linear warmup from 0 to
    `learning_rate`, then constant, cosine to 0, or linear to 0 at
    `num_steps`.
    """
    peak, warmup = optimizer.learning_rate, optimizer.warmup_steps
    decay = max(num_steps - warmup, 1)
    if optimizer.lr_schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay)
    elif optimizer.lr_schedule == "linear":
        after = optax.linear_schedule(peak, 0.0, decay)
    else:
        after = optax.constant_schedule(peak)
    by_step = (
        optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])
        if warmup
        else after
    )
    return lambda count: by_step(count // updates_per_step)


@dataclasses.dataclass(frozen=True, eq=False)
class Optimizer:
    """AdamW behind clip_by_global_norm (`transform`), and the learning-rate `schedule` it
    was built with, kept to report the rate of the last update (`last_learning_rate`)."""

    transform: optax.GradientTransformation
    schedule: optax.Schedule

    def last_learning_rate(self, opt_state) -> jax.Array:
        """The rate of the last update made to `opt_state` (the count after an update is
        that of the update just made plus one)."""
        return self.schedule(_update_count(opt_state) - 1)


def build_optimizer(
    optimizer: OptimizerConfig, *, num_steps: int, updates_per_step: int
) -> Optimizer:
    """AdamW behind clip_by_global_norm, at the rates of `learning_rate_schedule` (above):
    the one place a learning rate becomes a schedule (the warm start's optimizer is
    `trainer.warm_start.optimizer(trainer.optimizer)`, its own rate)."""
    schedule = learning_rate_schedule(
        optimizer, num_steps=num_steps, updates_per_step=updates_per_step
    )
    transform = optax.chain(
        optax.clip_by_global_norm(optimizer.grad_clip_norm),
        optax.adamw(
            schedule,
            b1=optimizer.adam_b1,
            b2=optimizer.adam_b2,
            eps=optimizer.adam_eps,
            weight_decay=optimizer.weight_decay,
        ),
    )
    return Optimizer(transform, schedule)


# -- forward passes -------------------------------------------------------------------------


def policy_temperature(inference: InferenceConfig) -> float:
    """The temperature T the trainer's policy log-probs are computed at: softmax(logits / T).

    The rollouts' sampling temperature (`inference.temperature`), so that π_θ, π_old and
    the reference are the distribution the inference workers' behaviour log-probs are of
    (rlax_tpu.inference.sampling.sample_tokens). Greedy rollouts (temperature 0) give 1:
    the sampler computes their behaviour log-probs at temperature 1. Either
    `logprobs_of` gives the same T; with "sampled" and top-k/top-p truncation the
    behaviour log-probs are of the truncated distribution, which the trainer does not
    reproduce (docs/trainer.md, "Sampling temperature").
    """
    temperature = float(inference.temperature)
    return temperature if temperature > 0 else 1.0


def _targets(tokens: jax.Array) -> jax.Array:
    return jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)


def policy_outputs(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: jax.Array,
    targets: jax.Array,
    *,
    values: bool,
    entropy: bool,
    temperature: float = 1.0,
    options: ForwardOptions = REFERENCE,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    prefix_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """log π(targets) float32[b, s], and the value head and entropies when asked; π (and
    its entropy) is softmax(logits / temperature). positions, segment_ids (and with shared
    prompts prefix_ids): int32[b, s] of packed rows (`Transformer.forward_train`); None for
    padded rows."""
    tokens = constrain(tokens, ("batch", "length"))
    targets = constrain(targets, ("batch", "length"))
    model = nnx.merge(graphdef, params)
    out = model.forward_train(
        tokens,
        targets,
        positions=positions,
        segment_ids=segment_ids,
        prefix_ids=prefix_ids,
        return_entropy=entropy,
        temperature=temperature,
        options=options,
    )
    return out.logprobs, (out.values if values else None), out.entropies


def _chunks(x: jax.Array, n: int) -> jax.Array:
    """[n·k, ...] -> [n, k, ...] (row blocks, in order)."""
    return x.reshape((n, x.shape[0] // n, *x.shape[1:]))


# -- packed batches (issue 42) -------------------------------------------------------------
# A chunk (a mini-batch, or the whole batch for the recompute) of B padded rows of T tokens
# runs as M packed micro-batches of R rows of P = trainer.tokens_per_row tokens
# (packing.PackedLayout): its tokens and targets are gathered from the padded arrays, the
# model's outputs are gathered back to the padded layout (0 off the sequences), where every
# objective, normalisation and metric reads them as it does a padded batch's.


def _pack(x: jax.Array, source: jax.Array) -> jax.Array:
    """A chunk's padded x[B, T, ...] gathered into the packed layout: [*source.shape, ...],
    0 on padding (`source` points past the end there)."""
    flat = x.reshape((-1, *x.shape[2:]))
    flat = jnp.concatenate([flat, jnp.zeros((1, *flat.shape[1:]), flat.dtype)])
    return flat[source]


def _unpack(x: jax.Array, unpack: jax.Array) -> jax.Array:
    """Packed outputs x[M, R, P, ...] of a chunk gathered back to its padded layout:
    [*unpack.shape, ...] ([B, T, ...]), 0 past each sequence's length."""
    flat = x.reshape((-1, *x.shape[3:]))
    flat = jnp.concatenate([flat, jnp.zeros((1, *flat.shape[1:]), flat.dtype)])
    return flat[unpack]


def _pack_cotangent(c: jax.Array, layout: PackedLayout) -> jax.Array:
    """Cotangents of a chunk's padded outputs c[B, T, ...] in its packed layout (pass 2 of a
    packed step): the transpose of `_unpack`, which with shared prompts sums the samples'
    cotangents on the prompt's slots; without, a gather suffices (each slot has one padded
    position)."""
    if layout.prefix_ids is None:
        return _pack(c, layout.source)
    shape, size = layout.source.shape, layout.source.size
    flat = jnp.zeros((size + 1, *c.shape[2:]), c.dtype)
    flat = flat.at[layout.unpack.reshape(-1)].add(c.reshape((-1, *c.shape[2:])))
    return flat[:size].reshape((*shape, *c.shape[2:]))


def _packed_inputs(tokens: jax.Array, targets: jax.Array, layout: PackedLayout) -> tuple:
    """(tokens, targets, positions, segment_ids, prefix_ids), each int32[M, R, P] (prefix_ids
    None without shared prompts), of one chunk. The targets are the padded rows' (tokens
    shifted left), so a sequence's last target is its own next token, never the next
    segment's first."""
    source = layout.source
    return (
        _pack(tokens, source),
        _pack(targets, source),
        layout.positions,
        layout.segment_ids,
        layout.prefix_ids,
    )


def _over_used(fn: Callable, xs: Any, used: jax.Array) -> Any:
    """fn over the packed micro-batches xs (leading axis M), stacked; a micro-batch past the
    `used` ones (all padding) is skipped and gives zeros. A scan of M steps whose body runs
    only for the used ones (`lax.cond`): the work follows the tokens, and the trip count
    stays static, so `rlax-tpu compile` counts the worst case (every micro-batch used)."""
    m = jax.tree.leaves(xs)[0].shape[0]
    first = jax.tree.map(lambda x: x[0], xs)
    shapes = jax.eval_shape(fn, first)

    def micro(_, ys):
        k, x = ys
        skip = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
        return None, jax.lax.cond(k < used, lambda: fn(x), skip)

    return jax.lax.scan(micro, None, (jnp.arange(m), xs))[1]


class Recomputed(NamedTuple):
    logprobs: jax.Array  # float32[G, T]: log π_old(targets)
    values: jax.Array | None  # float32[G, T]: V_old, when asked for


def recompute(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: jax.Array,
    *,
    micro_size: int,
    values: bool = False,
    temperature: float = 1.0,
    options: ForwardOptions = REFERENCE,
    layout: PackedLayout | None = None,
) -> Recomputed:
    """π_old's log-probs of every row's targets (and the value head's V_old when `values`),
    micro-batch by micro-batch, under `params` and without gradient; π_old is
    softmax(logits / temperature) (`policy_temperature`: the rollouts' temperature).

    The forward is wrapped in `jax.checkpoint(policy=nothing_saveable)` so that it keeps no
    activation for a backward pass: its graph is the plain forward that inference runs,
    and log-probs use the sampler's formula (`logprob_formula="inference"`:
    rlax_tpu.models.logprobs.inference_logprobs), so the recomputed π_old matches the
    inference workers' log-probs (docs/trainer.md says how closely).

    layout: the whole batch packed as one chunk (trainer.tokens_per_row > 0; arrays with a
    leading axis of 1): the used packed micro-batches run instead of the padded ones, and
    the results are 0 past each row's sequence length (`packing.sequence_lengths`).
    """

    def forward(p, t, targets=None, positions=None, segment_ids=None, prefix_ids=None):
        t = constrain(t, ("batch", "length"))
        if targets is None:
            targets = _targets(t)
        out = nnx.merge(graphdef, p).forward_train(
            t,
            targets,
            positions=positions,
            segment_ids=segment_ids,
            prefix_ids=prefix_ids,
            logprob_formula="inference",
            temperature=temperature,
            options=options,
        )
        return out.logprobs, (out.values if values else None)

    forward = jax.checkpoint(forward, policy=jax.checkpoint_policies.nothing_saveable)
    if layout is not None:
        one = jax.tree.map(lambda x: x[0], layout)
        xs = _packed_inputs(tokens, _targets(tokens), one)
        outs = _over_used(lambda x: forward(params, *x), xs, one.used)
        lp, v = jax.tree.map(lambda o: jax.lax.stop_gradient(_unpack(o, one.unpack)), outs)
        return Recomputed(lp, None if v is None else v.astype(jnp.float32))
    n = tokens.shape[0] // micro_size
    lp, v = jax.lax.map(lambda t: forward(params, t), _chunks(tokens, n))
    lp = jax.lax.stop_gradient(lp.reshape(tokens.shape))
    if v is not None:
        v = jax.lax.stop_gradient(v.reshape(tokens.shape).astype(jnp.float32))
    return Recomputed(lp, v)


def recompute_logprobs(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: jax.Array,
    *,
    micro_size: int,
    temperature: float = 1.0,
    options: ForwardOptions = REFERENCE,
    layout: PackedLayout | None = None,
) -> jax.Array:
    """`recompute(...).logprobs`: float32[G, T]."""
    return recompute(
        graphdef,
        params,
        tokens,
        micro_size=micro_size,
        temperature=temperature,
        options=options,
        layout=layout,
    ).logprobs


# -- the RL update ---------------------------------------------------------------------------


def _dense_group_ids(group_ids: jax.Array) -> jax.Array:
    """Relabel int32[b] group ids into [0, b) (a mini-batch slice of a global batch keeps
    ids up to G): each row gets the index of the first row of its group."""
    same = group_ids[:, None] == group_ids[None, :]
    return jnp.argmax(same, axis=1).astype(jnp.int32)


def _mean_metrics(metrics: Metrics) -> Metrics:
    """Mean over the leading (update) axis, ignoring NaN (e.g. a quantile of no tokens)."""
    return {k: jnp.nanmean(v.astype(jnp.float32)) for k, v in metrics.items()}


TRAINABLE = ("all", "adapters", "base")


def trainable_parts(trainable: str) -> tuple[Callable, Callable]:
    """(split, join) of a params tree into what an optimizer trains and what stays frozen:
    "all": the whole tree is trained (split(params) = (params, None)); with LoRA
    (model.lora), "adapters": split(params) = (adapters, base), the RL steps'; "base":
    (base, adapters), a warm start's (its SFT trains the base the adapters then sit on).
    join(train, frozen) is the whole tree again."""
    if trainable == "adapters":
        return lora_lib.split, lambda train, frozen: lora_lib.combine(frozen, train)
    if trainable == "base":
        return (
            lambda params: lora_lib.split(params)[::-1],
            lambda train, frozen: lora_lib.combine(train, frozen),
        )
    if trainable != "all":
        raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
    return (lambda params: (params, None)), (lambda train, frozen: train)


def _apply(optimizer: Optimizer, params, opt_state, grads):
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.transform.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, grad_norm


def _update_count(opt_state) -> jax.Array:
    """The adam step counter (updates made so far) inside the chain's state."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)):
        if isinstance(leaf, optax.ScaleByAdamState):
            return leaf.count
    raise ValueError("no Adam state in the optimizer state")


def make_rl_step(
    graphdef: nnx.GraphDef,
    objective: Objective,
    optimizer: Optimizer,
    levels: BatchLevels,
    *,
    temperature: float = 1.0,
    options: ForwardOptions = REFERENCE,
    packed: bool = False,
    trainable: str = "all",
) -> Callable:
    """The RL update of one global batch, to be jitted:

        (params, opt_state, batch, step, behaviour[, layout]) -> (params, opt_state, metrics)

    batch: a `RolloutBatch` of G rows whose behaviour_logprobs (and reference_logprobs,
    values) already hold what the objective should read. It is split into `num_updates`
    mini-batches (one optimizer update each); a mini-batch whose objective is computed
    over `micro_per_mini` > 1 micro-batches is differentiated in two passes so that the
    result is exactly that of the whole mini-batch for any objective (group advantages,
    token-mean weights): a forward over the micro-batches gives log π (values,
    entropies) of the mini-batch, the objective gives ∂loss/∂log π, and each micro-batch
    back-propagates Σ ∂loss/∂log π · log π_θ, accumulated.

    behaviour: {name: float32[G, T]}, behaviour log-probs to report against (the
    recomputed and the cached ones): `logprob_diff/{name}_mean` and `_p95` are
    |log π_θ − log π_name| over response tokens, π_θ being the policy at the start of each
    update, averaged over the updates like the objective's `logprob_diff/*` (which is
    against the log-probs in use).

    temperature: log π_θ and the entropies are of softmax(logits / temperature), the
    temperature the batch's behaviour (and reference) log-probs were computed at
    (`policy_temperature`).

    packed (trainer.tokens_per_row > 0): the step takes `layout`, a `PackedLayout` of the
    batch's mini-batches (one chunk each), and each mini-batch runs as its used packed
    micro-batches instead of its padded ones, in the two passes above: pass 1 gathers log π
    (values, entropies) back to the padded [mini, T] layout (0 off the sequences), where the
    objective runs exactly as on a padded batch; its cotangents are gathered into the packed
    layout for pass 2. With micro_per_mini == 1 the one packed micro-batch is differentiated
    directly through the unpacking gather (one forward, one backward; packing saves nothing
    there: the packed micro-batch has the padded one's shape). The loss, every metric and
    the gradient are the padded step's within float rounding.

    trainable: what of `params` is differentiated and updated (`trainable_parts`; with LoRA
    "adapters": the optimizer state is the adapters', the base goes through unchanged).
    """
    split_params, join_params = trainable_parts(trainable)
    need_values = objective.needs_values
    need_entropy = objective.needs_entropy
    m = levels.micro_per_mini

    def outputs(params, tokens, targets=None, positions=None, segment_ids=None, prefix_ids=None):
        return policy_outputs(
            graphdef,
            params,
            tokens,
            _targets(tokens) if targets is None else targets,
            values=need_values,
            entropy=need_entropy,
            temperature=temperature,
            options=options,
            positions=positions,
            segment_ids=segment_ids,
            prefix_ids=prefix_ids,
        )

    def loss_of(mini: RolloutBatch, step, lp, values, entropy):
        return objective(mini, lp, values=values, entropy=entropy, step=step)

    def direct_grads(params, frozen, mini, step):
        def loss_fn(p):
            lp, values, entropy = outputs(join_params(p, frozen), mini.tokens)
            loss, metrics = loss_of(mini, step, lp, values, entropy)
            return loss, (metrics, lp)

        (loss, (metrics, lp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return (loss, metrics), grads, lp

    def accumulated_grads(params, frozen, mini, step):
        # Pass 1: outputs of the whole mini-batch, micro-batch by micro-batch, no grad.
        whole = join_params(params, frozen)
        outs = jax.lax.map(lambda t: outputs(whole, t), _chunks(mini.tokens, m))
        lp, values, entropy = jax.tree.map(
            lambda x: x.reshape((levels.mini_size, *x.shape[2:])), outs
        )
        (loss, metrics), cotangents = jax.value_and_grad(
            lambda o: loss_of(mini, step, *o), has_aux=True
        )((lp, values, entropy))
        cot_chunks = jax.tree.map(lambda x: _chunks(x, m), cotangents)

        # Pass 2: back-propagate the objective's cotangents through each micro-batch.
        def micro(grads, xs):
            tokens, cot = xs

            def surrogate(p):
                o = outputs(join_params(p, frozen), tokens)
                return sum(
                    jnp.sum(c.astype(jnp.float32) * x.astype(jnp.float32))
                    for c, x in zip(cot, o, strict=True)
                    if c is not None
                )

            g = jax.grad(surrogate)(params)
            return jax.tree.map(jnp.add, grads, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(micro, zeros, (_chunks(mini.tokens, m), cot_chunks))
        return (loss, metrics), grads, lp

    def packed_grads(params, frozen, mini, step, layout: PackedLayout):
        # Pass 1: outputs of the used packed micro-batches, no grad, in the padded layout.
        xs = _packed_inputs(mini.tokens, _targets(mini.tokens), layout)
        whole = join_params(params, frozen)
        outs = _over_used(lambda x: outputs(whole, *x), xs, layout.used)
        lp, values, entropy = jax.tree.map(lambda o: _unpack(o, layout.unpack), outs)
        (loss, metrics), cotangents = jax.value_and_grad(
            lambda o: loss_of(mini, step, *o), has_aux=True
        )((lp, values, entropy))
        cot_packed = jax.tree.map(lambda c: _pack_cotangent(c, layout), cotangents)

        # Pass 2: back-propagate the packed cotangents through each used micro-batch.
        def micro(grads, ys):
            k, x, cot = ys

            def surrogate(p):
                o = outputs(join_params(p, frozen), *x)
                return sum(
                    jnp.sum(c.astype(jnp.float32) * y.astype(jnp.float32))
                    for c, y in zip(cot, o, strict=True)
                    if c is not None
                )

            def accumulate():
                return jax.tree.map(jnp.add, grads, jax.grad(surrogate)(params))

            return jax.lax.cond(k < layout.used, accumulate, lambda: grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(micro, zeros, (jnp.arange(m), xs, cot_packed))
        return (loss, metrics), grads, lp

    def packed_direct_grads(params, frozen, mini, step, layout: PackedLayout):
        # One packed micro-batch holds the mini-batch (micro == mini): differentiate the
        # objective through the unpacking gather, one forward and one backward, as padded.
        xs = _packed_inputs(mini.tokens, _targets(mini.tokens), layout)
        one = jax.tree.map(lambda x: x[0], xs)

        def loss_fn(p):
            outs = outputs(join_params(p, frozen), *one)
            lp, values, entropy = jax.tree.map(lambda o: _unpack(o[None], layout.unpack), outs)
            loss, metrics = loss_of(mini, step, lp, values, entropy)
            return loss, (metrics, lp)

        (loss, (metrics, lp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return (loss, metrics), grads, lp

    grads_of = direct_grads if m == 1 else accumulated_grads
    packed_grads_of = packed_direct_grads if m == 1 else packed_grads

    def rl_step(
        params,
        opt_state,
        batch: RolloutBatch,
        step,
        behaviour: dict[str, jax.Array],
        layout: PackedLayout | None = None,
    ):
        if packed != (layout is not None):
            raise TypeError(
                "a packed RL step takes the batch's PackedLayout, a padded one none "
                f"(packed={packed}, layout given: {layout is not None})"
            )
        minis = jax.tree.map(lambda x: _chunks(x, levels.num_updates), (batch, behaviour))
        minis = (*minis, layout)
        params, frozen = split_params(params)

        def update(carry, xs):
            params, opt_state = carry
            mini, mini_behaviour, mini_layout = xs
            mini = mini.replace(group_ids=_dense_group_ids(mini.group_ids))
            if packed:
                (loss, metrics), grads, lp = packed_grads_of(
                    params, frozen, mini, step, mini_layout
                )
            else:
                (loss, metrics), grads, lp = grads_of(params, frozen, mini, step)
            params, opt_state, grad_norm = _apply(optimizer, params, opt_state, grads)
            metrics = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
            metrics.update(loss=loss, grad_norm=grad_norm)
            metrics.update(behaviour_diff_metrics(lp, mini_behaviour, mini.response_mask))
            return (params, opt_state), metrics

        (params, opt_state), metrics = jax.lax.scan(update, (params, opt_state), minis)
        out = _mean_metrics(metrics)
        out["learning_rate"] = optimizer.last_learning_rate(opt_state)
        return join_params(params, frozen), opt_state, out

    return rl_step


def behaviour_diff_metrics(
    logprobs: jax.Array, behaviour: dict[str, jax.Array], response_mask: jax.Array
) -> Metrics:
    """|log π_θ − log π_name| over response tokens, mean and p95, for each named array."""
    mask = response_mask.astype(jnp.float32)
    out = {}
    for name, other in behaviour.items():
        diff = jnp.abs(jnp.where(mask > 0, logprobs.astype(jnp.float32) - other, 0.0))
        out[f"logprob_diff/{name}_mean"] = masked_mean(diff, mask)
        out[f"logprob_diff/{name}_p95"] = masked_quantile(diff, mask, 0.95)
    return out


def mismatch_metrics(recomputed: jax.Array, cached: jax.Array, response_mask: jax.Array) -> Metrics:
    """|log π_recomputed − log π_cached| over response tokens: mean and p95.

    The gap between the trainer's and the inference workers' log-probs of the same
    tokens under the same version (RLAX §5): numerics, not policy change.
    """
    mask = response_mask.astype(jnp.float32)
    diff = jnp.abs(jnp.where(mask > 0, recomputed - cached, 0.0))
    return {
        "mismatch/recomputed_vs_cached_mean": masked_mean(diff, mask),
        "mismatch/recomputed_vs_cached_p95": masked_quantile(diff, mask, 0.95),
    }


# -- SFT --------------------------------------------------------------------------------------


def make_sft_step(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    levels: BatchLevels,
    *,
    options: ForwardOptions = REFERENCE,
    packed: bool = False,
    trainable: str = "all",
) -> Callable:
    """The SFT update of one global batch, to be jitted:

        (params, opt_state, tokens, targets, loss_mask[, layout]) -> (params, opt_state, metrics)

    tokens, targets: int32[G, T]; loss_mask: float[G, T]. The loss of a mini-batch is the
    token-mean NLL −Σ mask·log π / Σ mask; its gradient w.r.t. log π is −mask / Σ mask,
    known before the forward, so micro-batches accumulate it exactly in one pass each.
    SFT trains the model's own distribution: log π at temperature 1, whatever the
    inference temperature.

    packed (trainer.tokens_per_row > 0): the step takes `layout`, a `PackedLayout` of the
    mini-batches (sequence lengths from the loss mask), and each mini-batch's used packed
    micro-batches run instead of its padded ones, with the tokens, targets and loss mask
    gathered into the packed layout: the same loss and gradient within float rounding.

    trainable: what of `params` is trained, as in `make_rl_step`.
    """
    m = levels.micro_per_mini
    split_params, join_params = trainable_parts(trainable)

    def update(carry, xs, frozen):
        params, opt_state = carry
        tokens, targets, mask, layout = xs
        mask = mask.astype(jnp.float32)
        total = jnp.maximum(jnp.sum(mask), 1.0)

        def micro(acc, ys):
            grads, nll = acc
            if packed:
                k, (t, y, positions, segment_ids, _), w = ys  # SFT shares no prompts
            else:
                (t, y, w), positions, segment_ids = ys, None, None

            def loss_fn(p):
                lp = policy_outputs(
                    graphdef,
                    join_params(p, frozen),
                    t,
                    y,
                    values=False,
                    entropy=False,
                    options=options,
                    positions=positions,
                    segment_ids=segment_ids,
                )[0]
                return -jnp.sum(jnp.where(w > 0, lp * w, 0.0)) / total

            def accumulate():
                loss, g = jax.value_and_grad(loss_fn)(params)
                return jax.tree.map(jnp.add, grads, g), nll + loss

            if packed:
                return jax.lax.cond(k < layout.used, accumulate, lambda: (grads, nll)), None
            return accumulate(), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32))
        if packed:
            packed_mask = _pack(mask, layout.source)
            ys = (jnp.arange(m), _packed_inputs(tokens, targets, layout), packed_mask)
        else:
            ys = (_chunks(tokens, m), _chunks(targets, m), _chunks(mask, m))
        (grads, nll), _ = jax.lax.scan(micro, init, ys)
        params, opt_state, grad_norm = _apply(optimizer, params, opt_state, grads)
        return (params, opt_state), {
            "loss": nll,
            "nll": nll,
            "grad_norm": grad_norm,
            "tokens": total,
        }

    def sft_step(params, opt_state, tokens, targets, loss_mask, layout=None):
        if packed != (layout is not None):
            raise TypeError(
                "a packed SFT step takes the batch's PackedLayout, a padded one none "
                f"(packed={packed}, layout given: {layout is not None})"
            )
        n = levels.num_updates
        xs = (_chunks(tokens, n), _chunks(targets, n), _chunks(loss_mask, n), layout)
        params, frozen = split_params(params)
        (params, opt_state), metrics = jax.lax.scan(
            lambda carry, x: update(carry, x, frozen), (params, opt_state), xs
        )
        out = _mean_metrics(metrics)
        out["learning_rate"] = optimizer.last_learning_rate(opt_state)
        out["tokens"] = jnp.sum(metrics["tokens"])
        return join_params(params, frozen), opt_state, out

    return sft_step


# -- FLOPs -------------------------------------------------------------------------------------


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def train_flops(num_params: int, tokens: int, trained: int | None = None) -> float:
    """Model FLOPs of a forward + backward over `tokens` tokens: 2·N forward, 2·N for the
    activations' gradients and 2 per trained parameter for the weights' (`trained`, default
    all N): 6·N·tokens, or with LoRA's frozen base (4·N + 2·adapters)·tokens."""
    trained = num_params if trained is None else trained
    return (4.0 * num_params + 2.0 * trained) * tokens
