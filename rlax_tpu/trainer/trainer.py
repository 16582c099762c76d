"""The trainer (DESIGN §5): a passive component that trains exactly the step it is asked
to, publishes the new version and checkpoints, and can be killed and restored any time.

The step counter is the model version: `train_step(s, batch)` trains batch s on version
s and publishes version s + 1. Asking again for a step already done returns its
recorded result (also after a restore: results live in the checkpoint); asking for a
later step than the next one is an `OutOfOrderStepError`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu import storage
from rlax_tpu.algorithms import RolloutBatch, build_objective, reference_reset_due
from rlax_tpu.config import RunConfig
from rlax_tpu.models import Transformer
from rlax_tpu.sharding import build_mesh, logical_to_spec, state_shardings, use_mesh
from rlax_tpu.trainer import perf
from rlax_tpu.trainer.checkpoints import CheckpointStore, NoValidCheckpointError
from rlax_tpu.trainer.step import (
    BatchLevels,
    build_optimizer,
    count_params,
    make_rl_step,
    make_sft_step,
    mismatch_metrics,
    policy_temperature,
    recompute,
    train_flops,
)

_log = logging.getLogger(__name__)


class OutOfOrderStepError(ValueError):
    """A step was asked for before the steps preceding it were trained."""


class NotInitializedError(RuntimeError):
    """The trainer was used before `initialize()` (or `restore()`)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a train step reports: `version` = step + 1 was published."""

    step: int
    version: int
    metrics: dict[str, float]
    already_done: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "metrics": self.metrics}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepResult:
        metrics = {k: (math.nan if v is None else float(v)) for k, v in data["metrics"].items()}
        return cls(step=int(data["step"]), version=int(data["version"]), metrics=metrics)


def _from_host(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from `host` (the whole value, the same in every process): each process
    places only the slices of its own devices."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _json_float(x: float) -> float | None:
    return None if not math.isfinite(x) else x


class Trainer:
    """Sharded RL / SFT trainer over `config.trainer.mesh` (or the `mesh` given).

    Call `initialize()` once; then `train_step(s, batch)` / `sft_step(...)` for s = step.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        param_server: Any | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        self.config = config
        self.levels = BatchLevels.from_config(config)
        self.mesh = mesh if mesh is not None else build_mesh(config.trainer.mesh)
        # A mesh over several hosts' devices (multi-host: DESIGN §5, rlax_tpu.distributed):
        # every process runs this same code on the same inputs, in lockstep.
        self._spans_processes = len({d.process_index for d in self.mesh.devices.flat}) > 1
        self.rules = config.trainer.mesh.logical_axis_rules
        self.objective = build_objective(config.trainer.algorithm)
        self.param_server = param_server
        if config.controller.samples_per_prompt > 1 and (
            self.levels.mini_size % config.controller.samples_per_prompt
        ):
            _log.warning(
                "trainer.mini_batch_size (%d) is not a multiple of samples_per_prompt (%d): "
                "groups are split across optimizer updates and their advantages are computed "
                "from partial groups",
                self.levels.mini_size,
                config.controller.samples_per_prompt,
            )

        model_cfg = config.model
        abstract_model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
        self._graphdef, abstract_state = nnx.split(abstract_model, nnx.Param)
        self._param_shardings = nnx.to_pure_dict(
            state_shardings(abstract_state, self.mesh, self.rules)
        )
        abstract_params = jax.tree.map(
            lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
            nnx.to_pure_dict(abstract_state),
            self._param_shardings,
        )
        self._abstract_params = abstract_params
        self.num_params = count_params(abstract_params)

        self._optimizer, self._schedule = build_optimizer(
            config.trainer,
            num_steps=config.controller.num_steps,
            updates_per_step=self.levels.num_updates,
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        abstract_opt = jax.eval_shape(self._optimizer.init, abstract_params)
        self._opt_shardings = optax.tree_map_params(
            self._optimizer,
            lambda _, s: s,
            abstract_opt,
            self._param_shardings,
            transform_non_params=lambda _: replicated,
        )
        self._abstract_opt = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_opt,
            self._opt_shardings,
        )
        self._keeps_reference = self.objective.needs_reference_logprobs
        # π_θ, π_old and the reference at the rollouts' sampling temperature (greedy: 1),
        # the distribution the inference workers' behaviour log-probs are of; SFT at 1.
        self.temperature = policy_temperature(config.inference)

        self.checkpoints = CheckpointStore(
            storage.join(config.storage.run_dir, "checkpoints"),
            max_to_keep=config.trainer.max_checkpoints_to_keep,
        )
        self._build_functions()

        self.step = 0
        self._params: Any = None
        self._opt_state: Any = None
        self._reference: Any = None
        self._results: dict[int, StepResult] = {}
        self._last_metrics: dict[str, float] = {}
        self._peak_flops: float | None = None

    # -- jitted functions ---------------------------------------------------------------
    def _build_functions(self) -> None:
        p_sh, o_sh = self._param_shardings, self._opt_shardings
        # Metrics replicated: every process of a multi-host mesh can read them.
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._token_sharding = self._sharding(("batch", "length"), (self.levels.global_size, 1))
        self._init_opt = jax.jit(self._optimizer.init, out_shardings=o_sh)
        self._recompute = jax.jit(
            lambda params, tokens, values: recompute(
                self._graphdef,
                params,
                tokens,
                micro_size=self.levels.micro_size,
                values=values,
                temperature=self.temperature,
            ),
            static_argnums=2,
        )
        self._rl_step = jax.jit(
            make_rl_step(
                self._graphdef,
                self.objective,
                self._optimizer,
                self._schedule,
                self.levels,
                temperature=self.temperature,
            ),
            donate_argnums=(0, 1),
            out_shardings=(p_sh, o_sh, replicated),
        )
        self._sft_step = jax.jit(
            make_sft_step(self._graphdef, self._optimizer, self._schedule, self.levels),
            donate_argnums=(0, 1),
            out_shardings=(p_sh, o_sh, replicated),
        )
        self._mismatch = jax.jit(mismatch_metrics, out_shardings=replicated)
        model_cfg, seed = self.config.model, self.config.seed
        self._random_init = jax.jit(
            lambda: nnx.to_pure_dict(
                nnx.state(Transformer(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param)
            ),
            out_shardings=p_sh,
        )

    def _sharding(self, logical: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        spec = logical_to_spec(logical, self.rules, shape=shape, mesh=self.mesh)
        return NamedSharding(self.mesh, spec)

    def _place_rows(self, x: Any, dtype=None) -> jax.Array:
        """A host or device array with rows first, sharded over the batch axes.

        Multi-host: every process passes the same global batch and places the rows of its
        own devices (no cross-process traffic, no equality check).
        """
        logical = ("batch", "length")[: np.ndim(x)]
        sharding = self._sharding(logical, tuple(np.shape(x)))
        if sharding.is_fully_addressable or (
            isinstance(x, jax.Array) and not x.is_fully_addressable
        ):
            x = jnp.asarray(x, dtype) if dtype is not None else x
            return jax.device_put(x, sharding)
        return _from_host(np.asarray(x, dtype), sharding)

    # -- state ----------------------------------------------------------------------------
    def _require_state(self) -> None:
        if self._params is None:
            raise NotInitializedError("call Trainer.initialize() before training")

    def _copy(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)

    def _initial_params(self) -> Any:
        model_cfg = self.config.model
        if model_cfg.hf_checkpoint:
            from rlax_tpu.models.hf import load_model_for_config

            model = load_model_for_config(model_cfg, seed=self.config.seed)
            pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            if self._spans_processes:  # every process loaded the same checkpoint
                return jax.tree.map(
                    lambda x, s: _from_host(np.asarray(x), s), pure, self._param_shardings
                )
            return jax.device_put(pure, self._param_shardings)
        with use_mesh(self.mesh, self.rules):
            return self._random_init()

    def initialize(self) -> int:
        """Restore the newest valid checkpoint, or build version 0 (HF checkpoint or random
        from the seed); publish the current version (idempotent). Returns the step."""
        if self.checkpoints.steps(reload=True):
            self.restore()
        else:
            self._params = self._initial_params()
            self._opt_state = self._init_opt(self._params)
            self._reference = self._copy(self._params) if self._keeps_reference else None
            self.step = 0
            self._results = {}
            _log.info("trainer initialized version 0 (%d parameters)", self.num_params)
        self._publish(self.step)
        return self.step

    def _publish(self, version: int) -> None:
        if self.param_server is not None:
            receipt = self.param_server.publish(version, self._params)
            _log.info(
                "published version %d (%s)",
                version,
                "already present" if receipt.already_present else f"{receipt.bytes_sent} bytes",
            )

    def params(self) -> Any:
        """The current params: a pure dict of sharded jax arrays (do not mutate)."""
        self._require_state()
        return self._params

    def status(self) -> dict[str, Any]:
        """Step, version, last metrics and checkpoint steps (a save in flight included; no
        storage read, so Health can poll it during a save)."""
        return {
            "step": self.step,
            "version": self.step,
            "metrics": dict(self._last_metrics),
            "checkpoint_steps": self.checkpoints.steps(),
        }

    # -- steps --------------------------------------------------------------------------------
    def _check_order(self, step: int) -> StepResult | None:
        self._require_state()
        if step < self.step:
            recorded = self._results.get(step)
            if recorded is None:
                raise OutOfOrderStepError(
                    f"step {step} was trained before the checkpoint this trainer restored "
                    f"and its result is not recorded; the expected step is {self.step}"
                )
            return dataclasses.replace(recorded, already_done=True)
        if step > self.step:
            raise OutOfOrderStepError(
                f"asked to train step {step} but the expected step is {self.step} "
                f"(version {self.step} is the newest; steps are trained in order)"
            )
        return None

    def train_step(self, step: int, batch: RolloutBatch) -> StepResult:
        """Train batch `step` on version `step`, publish version step + 1, maybe checkpoint."""
        done = self._check_order(step)
        if done is not None:
            return done
        rows, seq = np.shape(batch.tokens)
        self.levels.check(rows, seq, self.config.trainer.max_seq_len)
        batch = jax.tree.map(self._place_rows, batch)
        start = time.perf_counter()
        with use_mesh(self.mesh, self.rules):
            # π_old and, for GAE, V_old: the value head before the update (stop-gradient).
            needs_values = self.objective.needs_rollout_values
            recomputed, old_values = self._recompute(self._params, batch.tokens, needs_values)
            recomputed.block_until_ready()
            recompute_s = time.perf_counter() - start
            cached = batch.behaviour_logprobs
            extra = self._mismatch(recomputed, cached, batch.response_mask)
            if self.config.trainer.behaviour_logprobs == "recomputed":
                batch = batch.replace(behaviour_logprobs=recomputed)
            if needs_values:
                batch = batch.replace(values=old_values)
            if self.objective.needs_reference_logprobs:
                batch = batch.replace(
                    reference_logprobs=self._recompute(self._reference, batch.tokens, False)[0]
                )
            self._params, self._opt_state, metrics = self._rl_step(
                self._params,
                self._opt_state,
                batch,
                jnp.asarray(step, jnp.int32),
                {"recomputed": recomputed, "cached": cached},
            )
            metrics = {**jax.device_get(metrics), **jax.device_get(extra)}
        step_s = time.perf_counter() - start
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["time/recompute_s"] = recompute_s
        return self._finish(step, metrics, tokens=rows * seq, step_s=step_s)

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> StepResult:
        """An SFT update (token-mean NLL of `targets` where `loss_mask` > 0), same versions.

        tokens, targets: int32[global_batch, seq]; loss_mask: float|bool[global_batch, seq].
        """
        done = self._check_order(step)
        if done is not None:
            return done
        rows, seq = np.shape(tokens)
        self.levels.check(rows, seq, self.config.trainer.max_seq_len)
        tokens = self._place_rows(tokens, jnp.int32)
        targets = self._place_rows(targets, jnp.int32)
        loss_mask = self._place_rows(loss_mask, jnp.float32)
        start = time.perf_counter()
        with use_mesh(self.mesh, self.rules):
            self._params, self._opt_state, metrics = self._sft_step(
                self._params, self._opt_state, tokens, targets, loss_mask
            )
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        step_s = time.perf_counter() - start
        return self._finish(step, metrics, tokens=rows * seq, step_s=step_s)

    def _finish(self, step: int, metrics: dict[str, float], *, tokens: int, step_s: float):
        if self._peak_flops is None:
            self._peak_flops = perf.matmul_peak_flops(self.mesh, self.config.model.dtype)
        metrics.update(
            {
                "time/step_s": step_s,
                "tokens_per_s": tokens / step_s,
                "mfu": perf.mfu(train_flops(self.num_params, tokens), step_s, self._peak_flops),
            }
        )
        self.step = step + 1
        if self._keeps_reference and reference_reset_due(self.config.trainer.algorithm, self.step):
            _log.info("resetting the reference policy to version %d", self.step)
            self._reference = self._copy(self._params)
        result = StepResult(step=step, version=self.step, metrics=metrics)
        self._results[step] = result
        self._last_metrics = metrics
        t_publish = time.perf_counter()
        self._publish(self.step)
        metrics["time/publish_s"] = time.perf_counter() - t_publish
        if self.step % self.config.trainer.checkpoint_every == 0:
            self.save(wait=False)
        return result

    # -- checkpoints ---------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        state = {"params": self._params, "opt_state": self._opt_state}
        if self._keeps_reference:
            state["reference"] = self._reference
        return state

    def _abstract_state(self) -> dict[str, Any]:
        state = {"params": self._abstract_params, "opt_state": self._abstract_opt}
        if self._keeps_reference:
            state["reference"] = self._abstract_params
        return state

    def save(self, *, wait: bool = True) -> int:
        """Checkpoint the current version (async unless `wait`); returns its step."""
        self._require_state()
        if self.step in self.checkpoints.steps():
            if wait:
                self.checkpoints.wait()
            return self.step
        results = [
            {**r.to_json(), "metrics": {k: _json_float(v) for k, v in r.metrics.items()}}
            for _, r in sorted(self._results.items())
        ]
        meta = {"step": self.step, "config_digest": self.config.digest(), "results": results}
        self.checkpoints.save(self.step, self._state(), meta, wait=wait)
        _log.info("checkpoint of step %d %s", self.step, "written" if wait else "started")
        return self.step

    def restore(self, step: int | None = None) -> int:
        """Load the newest valid checkpoint (or `step`) onto this trainer's mesh."""
        try:
            restored = self.checkpoints.restore(self._abstract_state(), step)
        except NoValidCheckpointError:
            raise
        state = restored.state
        self._params = state["params"]
        self._opt_state = state["opt_state"]
        self._reference = state.get("reference")
        self.step = restored.step
        self._results = {
            r.step: r
            for r in (StepResult.from_json(d) for d in restored.meta.get("results", []))
            if r.step < restored.step
        }
        if restored.meta.get("config_digest") != self.config.digest():
            _log.warning(
                "checkpoint %d was written by a run with another config digest", restored.step
            )
        _log.info(
            "restored checkpoint of step %d from %s", restored.step, self.checkpoints.directory
        )
        return self.step

    def close(self) -> None:
        """Wait for pending checkpoint saves."""
        self.checkpoints.close()
