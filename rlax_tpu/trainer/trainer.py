"""The trainer (DESIGN §5): a passive component that trains exactly the step it is asked
to, publishes the versions workers may load, checkpoints, and can be killed and restored
any time.

The step counter is the model version: `train_step(s, batch)` trains batch s on version
s and makes version s + 1, published only if a worker may load it (a multiple of η,
`staleness.reload_every`: `StalenessPolicy.publishes`) or it is the run's last. Asking
again for a step already done returns its recorded result (also after a restore: results
live in the checkpoint); asking for a later step than the next one is an
`OutOfOrderStepError`. A batch holding a rollout that batch s may not train on (generated
by a version v > s, or with s - v > N) is refused with `StaleRolloutError` before anything
changes: the trainer keeps the bound too.

With `trainer.warm_start.steps = S > 0`, version 0 is the initial model after an SFT warm start
of S steps: `sft_step(k, ...)` for k = 0 .. S-1 (at `trainer.warm_start.learning_rate`, with
its own optimizer state), then the trainer publishes version 0 and RL steps may begin. The
controller drives these steps over the same service as the RL steps, so a warm start works
wherever the trainer runs. The warm start has its own checkpoints (checkpoints_warm_start/):
every `trainer.warm_start.checkpoint_every` steps and on `save()` during it, so a crashed or
preempted warm start continues from the newest, and after its last step, so it is never
redone (a new run directory holding a copy of them starts RL from the same version 0).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rlax_tpu import run_dir as run_dir_layout
from rlax_tpu import storage
from rlax_tpu.algorithms import RolloutBatch, reference_reset_due
from rlax_tpu.api.trainer import BatchFormatError, StepResult, batch_digest
from rlax_tpu.checkpoints import CheckpointStore, NoValidCheckpointError
from rlax_tpu.colocation import SharedVersions, sent_already
from rlax_tpu.config import ConfigError, RunConfig
from rlax_tpu.config.run import rollout_correction_conflict
from rlax_tpu.failpoints import failpoint
from rlax_tpu.models import lora, lora_base
from rlax_tpu.models.hf import load_hf_sharded
from rlax_tpu.models.transformer import unstack_layers
from rlax_tpu.sharding import build_mesh, use_mesh
from rlax_tpu.staleness import StalenessPolicy
from rlax_tpu.trainer import perf
from rlax_tpu.trainer.programs import SENT_FIELDS, TrainerPrograms
from rlax_tpu.trainer.step import train_flops

_log = logging.getLogger(__name__)

WARM_START_CHECKPOINTS = run_dir_layout.WARM_START_CHECKPOINTS


class OutOfOrderStepError(ValueError):
    """A step was asked for before the steps preceding it were trained."""


class BatchMismatchError(OutOfOrderStepError):
    """A repeated step came with another batch than the one this trainer trained it on."""


class NotInitializedError(RuntimeError):
    """The trainer was used before `initialize()` (or `restore()`)."""


class WarmStartPendingError(NotInitializedError):
    """An RL step was asked for before the SFT warm start built version 0."""


class StaleRolloutError(ValueError):
    """A batch holds a rollout its step may not train on (from a version after the step, or
    more than `max_staleness` versions before it); nothing was trained."""


def _from_host(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from `host` (the whole value, the same in every process): each process
    places only the slices of its own devices."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _json_float(x: float) -> float | None:
    return None if not math.isfinite(x) else x


class Trainer:
    """Sharded RL / SFT trainer over `config.trainer.mesh` (or the `mesh` given).

    Call `initialize()` once; then `train_step(s, batch)` / `sft_step(...)` for s = step.
    `progress` receives one line per slow phase — a checkpoint restore, an HF checkpoint
    load, the first step of each batch shape (its compile) — never one per step; the
    server passes rpc.process.announce_progress (default: the log, at INFO).
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        param_server: Any | None = None,
        mesh: Mesh | None = None,
        progress: Callable[[str], None] | None = None,
        shared: SharedVersions | None = None,
    ) -> None:
        self.config = config
        self.progress = progress or _log.info
        self._compiled: set[tuple[str, int, int]] = set()  # (program, rows, seq) run once
        self.mesh = mesh if mesh is not None else build_mesh(config.trainer.mesh)
        # Model layout, optimizers and jitted functions: built from (config, mesh) by the
        # builder `rlax-tpu compile` also lowers for a TPU topology (trainer/programs.py).
        self.programs = programs = TrainerPrograms(config, self.mesh)
        if config.trainer.compiled_dir:
            loaded = programs.use_saved_executables(config.trainer.compiled_dir)
            _log.info(
                "trainer loaded the executables of %s from %s",
                ", ".join(loaded) or "no program",
                config.trainer.compiled_dir,
            )
        self.levels = programs.levels
        self.rules = programs.rules
        self.objective = programs.objective
        # A rollout correction (TIS/MIS, the mismatch gate) weighs π_old / π_rollout: π_old is
        # recomputed every step and the batch's cached log-probs become π_rollout.
        self._needs_rollout_logprobs = self.objective.needs_rollout_logprobs
        if self._needs_rollout_logprobs and config.trainer.behaviour_logprobs == "cached":
            raise ConfigError(
                rollout_correction_conflict(config.trainer.algorithm),
                field="trainer.behaviour_logprobs",
            )
        self.policy = StalenessPolicy.from_config(config.staleness)
        self.param_server = param_server
        self._unpublished: int | None = None  # a version whose publish failed
        # Co-located (inference.colocated): each published version is also handed to the
        # worker in this process (`shared`), and an RL step's send to the parameter server
        # runs in the background (`_sending`), ended before the trainer's next call.
        self.shared = shared
        self._sender = (
            concurrent.futures.ThreadPoolExecutor(1, "trainer-publish")
            if shared is not None
            else None
        )
        self._sending: tuple[int, concurrent.futures.Future] | None = None
        # inference.colocated_publish "needed": RL-step versions handed to the worker but not
        # sent to the parameter server; a checkpoint sends those it needs (`_send_needed`).
        self._sends_every = config.inference.colocated_publish == "every"
        self._unsent: set[int] = set()
        self._trained_here = False  # an RL step trained since the last restore
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

        self._graphdef = programs.graphdef
        self._param_shardings = programs.param_shardings
        self._abstract_params = programs.abstract_params
        self.num_params = programs.num_params
        self._opt_shardings, self._abstract_opt = programs.rl.shardings, programs.rl.abstract
        self.warm_start_steps = config.trainer.warm_start.steps
        self._abstract_sft_opt = programs.sft.abstract
        self._keeps_reference = self.objective.needs_reference_logprobs
        self.temperature = programs.temperature
        self.forward_options = programs.forward_options
        self._init_opt, self._init_sft_opt = programs.init_opt, programs.init_sft_opt
        self._recompute, self._mismatch = programs.recompute, programs.mismatch
        self._rl_step, self._sft_step = programs.rl_step, programs.sft_step
        self._random_init = programs.random_init

        self.checkpoints = CheckpointStore(
            storage.join(config.storage.run_dir, run_dir_layout.CHECKPOINTS),
            max_to_keep=config.trainer.max_checkpoints_to_keep,
        )
        self.warm_start_checkpoints = (
            CheckpointStore(
                storage.join(config.storage.run_dir, WARM_START_CHECKPOINTS), max_to_keep=2
            )
            if self.warm_start_steps
            else None
        )

        self.step = 0
        # The next SFT warm-start step; == warm_start_steps once version 0 exists.
        self.warm_start_step = self.warm_start_steps
        self._sft_opt_state: Any = None
        self._sft_results: dict[int, StepResult] = {}
        self._params: Any = None
        self._opt_state: Any = None
        self._reference: Any = None
        self._results: dict[int, StepResult] = {}
        self._last_metrics: dict[str, float] = {}
        self._peak_flops: float | None = None
        self._base_digest: bytes | None = None  # the LoRA base written (_lora_base_digest)

    def _place_rows(self, x: Any, dtype=None, sharding: NamedSharding | None = None) -> jax.Array:
        """A host or device array with rows first, sharded over the batch axes (or as
        `sharding` says).

        Multi-host: every process passes the same global batch and places the rows of its
        own devices (no cross-process traffic, no equality check).
        """
        sharding = sharding or self.programs.row_sharding(tuple(np.shape(x)))
        if sharding.is_fully_addressable or (
            isinstance(x, jax.Array) and not x.is_fully_addressable
        ):
            x = jnp.asarray(x, dtype) if dtype is not None else x
            return jax.device_put(x, sharding)
        return _from_host(np.asarray(x, dtype), sharding)

    def _layout(
        self, mask: Any, *, chunks: int, tokens: Any = None
    ) -> tuple[tuple, dict[str, float]]:
        """The packed layout of a batch with loss / response `mask` in `chunks` chunks,
        placed on the mesh, as the extra argument of a packed program, and its padding
        figures (`packing/*`); no argument and no figures when packing is off."""
        if not self.programs.tokens_per_row:
            return (), {}
        layout = self.programs.layout(mask, chunks=chunks, tokens=tokens)
        shardings = self.programs.layout_shardings(layout)
        placed = type(layout)(
            *(
                None if x is None else self._place_rows(x, sharding=sh)
                for x, sh in zip(layout, shardings, strict=True)
            )
        )
        tokens_padded = layout.padded_sequence_tokens
        figures = {
            # The share of the token slots that run which are padding, packed and padded.
            "packing/padding_fraction": 1 - layout.sequence_tokens / max(layout.packed_tokens, 1),
            "packing/padding_fraction_padded": 1 - tokens_padded / layout.padded_tokens,
            # The share of the sequences' tokens that shared prompts left out (0 unshared).
            "packing/shared_prompt_fraction": 1 - layout.sequence_tokens / max(tokens_padded, 1),
            # The tokens the model runs for the sequences (a shared prompt once): `mfu`'s.
            "model_tokens": layout.sequence_tokens,
        }
        return (placed,), figures

    # -- state ----------------------------------------------------------------------------
    def _require_state(self) -> None:
        if self._params is None:
            raise NotInitializedError("call Trainer.initialize() before training")

    def _copy(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)

    def _reference_copy(self) -> Any:
        """What the reference policy keeps of the current params: a copy of what training
        changes (with LoRA the adapters alone: the frozen base is the current one's)."""
        return self._copy(self.programs.split_trainable(self._params)[0])

    def _reference_params(self) -> Any:
        """The reference policy's whole params tree (`_reference_copy` on the frozen base)."""
        return self.programs.join_trainable(
            self._reference, self.programs.split_trainable(self._params)[1]
        )

    def _initial_params(self) -> Any:
        model_cfg = self.config.model
        if model_cfg.hf_checkpoint:
            # Straight into the params' shardings (stacked with trainer.scan_layers): each
            # process reads only its devices' shards, no device holds more than its own.
            self.progress(f"loading the HF checkpoint {model_cfg.hf_checkpoint} ...")
            t0 = time.perf_counter()
            params = load_hf_sharded(model_cfg, self._abstract_params, seed=self.config.seed)
            self.progress(
                f"loaded the HF checkpoint {model_cfg.hf_checkpoint} in "
                f"{time.perf_counter() - t0:.1f}s"
            )
            return params
        with use_mesh(self.mesh, self.rules):
            return self._random_init()

    def initialize(self) -> int:
        """Restore the newest valid checkpoint, or build version 0 (HF checkpoint or random
        from the seed); publish the current version (idempotent). Returns the step.

        With an SFT warm start (`trainer.warm_start.steps`) not yet done, the initial model and
        the warm start's optimizer state are set up (or its checkpoint restored) instead,
        and nothing is published until the warm start's last step."""
        if self.checkpoints.steps(reload=True):
            self.restore()
        elif self.warm_start_steps and self._restore_warm_start():
            if self.warm_start_step < self.warm_start_steps:
                return self.step  # the warm start goes on
            self._start_rl()  # its last checkpoint: version 0 is its model
        else:
            self._params = self._initial_params()
            self.step = 0
            self._results = {}
            if self.warm_start_steps:
                self._sft_opt_state = self._init_sft_opt(self._params)
                self.warm_start_step = 0
                _log.info(
                    "trainer initialized the model (%d parameters); version 0 follows an SFT "
                    "warm start of %d steps",
                    self.num_params,
                    self.warm_start_steps,
                )
                return self.step
            self._start_rl()
            _log.info("trainer initialized version 0 (%d parameters)", self.num_params)
        self._publish(self.step)
        return self.step

    def _start_rl(self) -> None:
        """Version 0 from the current params: a fresh RL optimizer state and reference."""
        self._opt_state = self._init_opt(self._params)
        self._reference = self._reference_copy() if self._keeps_reference else None
        self._sft_opt_state = None
        self.warm_start_step = self.warm_start_steps
        self._base_digest = None

    def _publish(self, version: int, *, background: bool = False) -> None:
        """Publish `version` if anything may read it (StalenessPolicy.publishes: a version
        workers may load, or the run's final one). The client waits for a parameter server
        that is down or restarting; one that stays down fails the call, and the version is
        published again before the next step (or the repeat of this one) is answered.

        Co-located (`shared`), the version is also handed to the worker in this process, and
        with `background` (an RL step's version, not the run's last) the send to the
        parameter server runs while the worker loads and generates; a send that fails is
        made again as above, before the trainer's next call. With colocated_publish
        "needed", such a version is sent only if it may be needed after it stops being held
        (`_outlives_hold`); otherwise a checkpoint that needs it sends it (`save`)."""
        self._wait_sent()
        final = self.config.controller.num_steps
        if not self.policy.publishes(version, final):
            return
        if self.shared is None:
            if self.param_server is not None:
                self._send(version, self._published_params())
            return
        # Handed as they are: a cast makes new arrays, and uncast they are the params, which
        # a co-located trainer's RL step does not update in place (TrainerPrograms.rl_step
        # donates only the optimizer state; no SFT step runs after version 0).
        params = self._published_params()
        if self.param_server is None:
            sent = sent_already()
        elif background and version != final and not self._sends_every:
            self._unsent = {v for v in self._unsent if v >= self.policy.oldest_needed(version)}
            if self._outlives_hold(version):
                sent = self._sender.submit(self._send, version, params)
                self._sending = (version, sent)
            else:
                sent = sent_already()  # while held, a checkpoint that needs it sends it
                self._unsent.add(version)
        elif background and version != final:
            sent = self._sender.submit(self._send, version, params)
            self._sending = (version, sent)
        else:
            self._send(version, params)
            sent = sent_already()
        self.shared.put(version, params, sent)

    def _outlives_hold(self, version: int) -> bool:
        """colocated_publish "needed": whether a resume may still generate with `version`
        after the worker's SharedVersions drops it, when the `keep`-th newer version is
        published (η apart): then a snapshot relies on the server's copy, sent now. On
        policy and one step off it never does (N < 2η with the default keep of 2), so only
        checkpoints send; further off-policy, each RL step's version goes in the background
        as with "every", and the process still holds only `keep` copies."""
        dropped_at = version + self.shared.keep * self.policy.reload_every
        return version >= self.policy.oldest_needed(dropped_at)

    def _send(self, version: int, params: Any) -> None:
        self._unpublished = version
        receipt = self.param_server.publish(version, params)
        self._unpublished = None
        self._unsent.discard(version)
        _log.info(
            "published version %d (%s)",
            version,
            "already present" if receipt.already_present else f"{receipt.bytes_sent} bytes",
        )

    def _wait_sent(self) -> None:
        """End the background send of the last version (co-located): a failure leaves the
        version in `_unpublished`, published again before the next step is answered."""
        sending, self._sending = self._sending, None
        if sending is None:
            return
        version, future = sending
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - sent again (see _check_order)
            _log.warning("publishing version %d failed (%s); publishing it again", version, e)

    def _send_needed(self) -> None:
        """colocated_publish "needed": before a checkpoint of the current step, send the
        versions a resume from it generates with ([oldest needed, step], as the controller's
        snapshot waits for them) that were only handed to the worker. Each is still held:
        one that may be needed after the worker drops it was sent at its publish
        (`_outlives_hold`)."""
        if not self._unsent or self.param_server is None:
            return
        final = self.config.controller.num_steps
        low = self.policy.oldest_needed(self.step)
        for version in self.policy.published(low, self.step, final):
            if version not in self._unsent:
                continue
            params = self.shared.held(version)
            if params is None:  # pragma: no cover - _outlives_hold sent it
                _log.warning("version %d is no longer held: a snapshot cannot rely on it", version)
                continue
            self._send(version, params)
        self._unsent = {v for v in self._unsent if v > low}

    def republish(self, version: int) -> None:
        """Publish `version` again: the one this trainer holds, which a restarted parameter
        server lost (committed, not yet on storage), or, co-located, one still held for the
        worker. Already held there: nothing is sent. OutOfOrderStepError for any other
        version (an older one can only come back from its checkpoint: a resume)."""
        self._require_state()
        held = None if self.shared is None or version == self.step else self.shared.held(version)
        if held is not None and self.param_server is not None:
            self._wait_sent()
            self._send(version, held)
            return
        if version != self.step or self.warm_start_step < self.warm_start_steps:
            raise OutOfOrderStepError(
                f"asked to publish version {version} again, but this trainer holds version "
                f"{self.step}{'' if version != self.step else ' of an unfinished warm start'}; "
                "an older version comes back only by resuming from a checkpoint"
            )
        self._publish(version)

    def _published_params(self) -> Any:
        """The params as inference workers serve them: the master params cast to
        `model.publish_dtype` on device, each array sharded as its master (the client reads
        this process's shards). The master params themselves when nothing is cast; else a
        temporary copy in the publish dtype, freed after the publish. Scanned layers
        (trainer.scan_layers) are published per layer, the one format of the wire, the
        parameter server and the workers: cast and sliced in one jitted call."""
        if self.programs.publish is None:
            return self._params
        if self.programs.lora:
            digest = lora_base.digest_leaf(self._lora_base_digest())
            packed = self.programs.publish(self._params)
            return {lora.PACKED_KEY: packed, lora_base.DIGEST_KEY: digest}
        return self.programs.publish(self._params)

    def _lora_base_digest(self) -> bytes:
        """The digest of the frozen base a LoRA version names, the base written to the run's
        base store (rlax_tpu.models.lora_base) first if it is not there. Computed once per
        base: RL steps never change it; only the start of RL (`_start_rl`, a warm start's
        end) and a restore bring a base, and they forget the digest."""
        if self._base_digest is None:
            base = self.programs.publish_base(self._params)
            digest = lora_base.base_digest(base)
            store = lora_base.LoraBaseStore(self.config.storage.run_dir)
            try:
                store.write(base, digest)
            finally:
                store.close()
            del base
            self._base_digest = digest
        return self._base_digest

    def params(self) -> Any:
        """The current params: a pure dict of sharded jax arrays (do not mutate), per layer
        (`layers/0/...`) also when the trainer scans stacked layers, as HF export and the
        parameter server take them; in `model.param_dtype`."""
        self._require_state()
        return unstack_layers(self._params)

    def status(self) -> dict[str, Any]:
        """Step, version, last metrics and checkpoint steps (a save in flight included; no
        storage read, so Health can poll it during a save)."""
        return {
            "step": self.step,
            "version": self.step,
            "metrics": dict(self._last_metrics),
            "checkpoint_steps": self.checkpoints.steps(),
            "warm_start_step": self.warm_start_step,
            "warm_start_steps": self.warm_start_steps,
        }

    # -- steps --------------------------------------------------------------------------------
    def _check_order(self, step: int, digest: str = "") -> StepResult | None:
        """None if `step` is the one to train; the recorded result of a step done before
        (`digest`: the repeat's batch, checked against the one trained); else an error."""
        self._require_state()
        self._wait_sent()
        if self._unpublished is not None and self._unpublished == self.step:
            self._publish(self._unpublished)  # its publish failed: the server was down
        if self.warm_start_step < self.warm_start_steps:
            raise WarmStartPendingError(
                f"asked to train step {step}, but version 0 does not exist yet: the SFT warm "
                f"start is at step {self.warm_start_step} of {self.warm_start_steps} (send "
                f"SftStep {self.warm_start_step}..{self.warm_start_steps - 1} first)"
            )
        if step < self.step:
            recorded = self._results.get(step)
            if recorded is None:
                raise OutOfOrderStepError(
                    f"step {step} was trained before the checkpoint this trainer restored "
                    f"and its result is not recorded; the expected step is {self.step}"
                )
            if digest and recorded.batch_digest and digest != recorded.batch_digest:
                raise BatchMismatchError(
                    f"step {step} is repeated with another batch than the one it was trained "
                    f"on (digest {digest} against {recorded.batch_digest}): the controller's "
                    "rollout log or snapshot does not match this trainer's state; restart the "
                    "trainer so the resume restores it from its checkpoint"
                )
            return dataclasses.replace(recorded, already_done=True)
        if step > self.step:
            raise OutOfOrderStepError(
                f"asked to train step {step} but the expected step is {self.step} "
                f"(version {self.step} is the newest; steps are trained in order)"
            )
        return None

    def train_step(self, step: int, batch: RolloutBatch) -> StepResult:
        """Train batch `step` on version `step`, making version step + 1 (published only if
        workers may load it, or it is the last), maybe checkpoint.
        A step trained before is answered from its record, if `batch` is the same."""
        digest = batch_digest(batch)
        done = self._check_order(step, digest)
        if done is not None:
            return done
        rows, seq = np.shape(batch.tokens)
        self.levels.check(rows, seq, self.config.trainer.max_seq_len)
        self._check_staleness(step, batch)
        self._check_inputs(batch)
        batch = batch.replace(token_versions=None)  # checked; no objective part reads it
        # Packed rows (trainer.tokens_per_row): the layouts of the update's mini-batches and,
        # on a step that runs a recompute, of the recompute's whole batch, from the response
        # mask (and, sharing prompts, the tokens).
        needs_values = self.objective.needs_rollout_values
        recompute = self._recompute_due(step)
        tokens = batch.tokens
        packed, packing = self._layout(
            batch.response_mask, chunks=self.levels.num_updates, tokens=tokens
        )
        packed_recompute = ()
        if recompute or self.objective.needs_reference_logprobs:
            packed_recompute, _ = self._layout(batch.response_mask, chunks=1, tokens=tokens)
        batch = jax.tree.map(self._place_rows, batch)
        first = self._first_of_shape("train step", rows, seq)
        start, compiled = time.perf_counter(), perf.compile_seconds()
        with use_mesh(self.mesh, self.rules):
            cached = batch.behaviour_logprobs
            recomputed, extra, recompute_s = cached, {}, 0.0
            if recompute:
                # π_old and, for GAE, V_old: the value head before the update (stop-gradient).
                recomputed, old_values = self._recompute(
                    self._params, batch.tokens, needs_values, *packed_recompute
                )
                recomputed.block_until_ready()
                recompute_s = time.perf_counter() - start
                extra = self._mismatch(recomputed, cached, batch.response_mask)
            if self.config.trainer.behaviour_logprobs == "recomputed":
                batch = batch.replace(behaviour_logprobs=recomputed)
            # π_rollout: the inference workers' log-probs as sent, when the objective reads
            # them (its rollout correction); else none, whatever the caller put there.
            batch = batch.replace(rollout_logprobs=cached if self._needs_rollout_logprobs else None)
            if needs_values:
                batch = batch.replace(values=old_values)
            if self.objective.needs_reference_logprobs:
                batch = batch.replace(
                    reference_logprobs=self._recompute(
                        self._reference_params(), batch.tokens, False, *packed_recompute
                    )[0]
                )
            self._params, self._opt_state, metrics = self._rl_step(
                self._params,
                self._opt_state,
                batch,
                jnp.asarray(step, jnp.int32),
                {"recomputed": recomputed, "cached": cached},
                *packed,
            )
            metrics = {**jax.device_get(metrics), **jax.device_get(extra), **packing}
            if not recompute:  # the same program ran with recomputed = cached: not a figure
                metrics = {k: v for k, v in metrics.items() if "recomputed" not in k}
        step_s = time.perf_counter() - start
        if first:
            self.progress(f"train step {rows}x{seq}: compiled and ran in {step_s:.1f}s")
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["time/recompute_s"] = recompute_s
        compile_s = perf.compile_seconds() - compiled
        return self._finish(
            step, metrics, tokens=rows * seq, step_s=step_s, compile_s=compile_s, digest=digest
        )

    def _recompute_due(self, step: int) -> bool:
        """Whether train step `step` recomputes π_old: when the objective reads it (recomputed
        behaviour log-probs, GAE's V_old, a rollout correction's π_old / π_rollout), else
        every trainer.recompute_every steps for the mismatch metrics."""
        trainer = self.config.trainer
        if (
            trainer.behaviour_logprobs == "recomputed"
            or self.objective.needs_rollout_values
            or self._needs_rollout_logprobs
        ):
            return True
        return bool(trainer.recompute_every) and step % trainer.recompute_every == 0

    def _check_inputs(self, batch: RolloutBatch) -> None:
        """BatchFormatError naming the first optional field the objective reads that only the
        sender can supply (dense rewards, given advantages or returns, baselines) and
        `batch` lacks; nothing was trained."""
        for name in SENT_FIELDS:
            if name in self.programs.inputs and getattr(batch, name) is None:
                raise BatchFormatError(
                    f"batch.{name}",
                    f"is missing: trainer.algorithm {self.config.trainer.algorithm.name!r} "
                    f"reads it ({self.objective!r}); the sender must fill it. Nothing was "
                    "trained",
                )

    def _check_staleness(self, step: int, batch: RolloutBatch) -> None:
        """StaleRolloutError unless every row's version v satisfies 0 <= step - v <= N: with
        per-token versions (mixed-version rollouts), every response token's where
        response_mask > 0 (an episode's given tokens carry placeholder versions and train
        nothing), and each row's `versions` entry must be its oldest such token's
        (BatchFormatError otherwise)."""
        versions = np.asarray(batch.versions)
        if batch.token_versions is not None:
            versions = self._token_versions_to_check(step, batch, versions)
        bad = [
            row for row, v in enumerate(versions.tolist()) if not self.policy.is_acceptable(step, v)
        ]
        if not bad:
            return
        row, version = bad[0], int(versions[bad[0]])
        n = self.policy.max_staleness
        why = (
            f"a version after step {step}"
            if version > step
            else f"{step - version} versions old, over max_staleness N={n}"
        )
        raise StaleRolloutError(
            f"batch {step} refused: row {row} (group {int(np.asarray(batch.group_ids)[row])}) "
            f"{'has tokens of' if batch.token_versions is not None else 'was generated by'} "
            f"version {version}, {why}; batch {step} accepts versions "
            f"{max(0, step - n)}..{step} ({len(bad)} of {len(versions)} rows are out of "
            "bounds). Nothing was trained."
        )

    @staticmethod
    def _token_versions_to_check(step: int, batch: RolloutBatch, versions: Any) -> np.ndarray:
        """Per row, the version of its masked-in response tokens that fails the bound if any
        does: the newest when it is after `step`, else the oldest (which `versions` must
        equal: BatchFormatError otherwise)."""
        token_versions = np.asarray(batch.token_versions)
        mask = np.asarray(batch.response_mask) > 0
        if token_versions.shape != mask.shape:
            raise BatchFormatError(
                "batch.token_versions",
                f"has shape {token_versions.shape}, the batch's tokens {mask.shape}",
            )
        has_tokens = mask.any(axis=1)
        lo = np.where(
            has_tokens, np.where(mask, token_versions, np.iinfo(np.int32).max).min(1), versions
        )
        hi = np.where(has_tokens, np.where(mask, token_versions, -1).max(1), versions)
        wrong = np.flatnonzero(lo != versions)
        if wrong.size:
            row = int(wrong[0])
            raise BatchFormatError(
                "batch.versions",
                f"row {row} says version {int(versions[row])} but its oldest response token "
                f"is version {int(lo[row])}'s (batch.token_versions): a row's version is its "
                "oldest token's. Nothing was trained",
            )
        return np.where(hi > step, hi, lo)

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> StepResult:
        """SFT warm-start step `step` of `trainer.warm_start.steps` (token-mean NLL of `targets`
        where `loss_mask` > 0); after the last one, version 0 is published.

        tokens, targets: int32[global_batch, seq]; loss_mask: float|bool[global_batch, seq].
        Idempotent like `train_step`: a step already done returns its recorded result.
        """
        self._require_state()
        total = self.warm_start_steps
        if not 0 <= step < total:
            raise OutOfOrderStepError(
                f"SFT step {step} is not part of the warm start: this trainer's config has "
                f"trainer.warm_start.steps = {total}"
                + (f" (SFT steps 0..{total - 1} come before version 0)" if total else "")
            )
        if step < self.warm_start_step:
            recorded = self._sft_results.get(step)
            if recorded is None:  # done before a restore: the result is not kept
                recorded = StepResult(step=step, version=-1, metrics={})
            return dataclasses.replace(recorded, already_done=True)
        if step > self.warm_start_step:
            raise OutOfOrderStepError(
                f"asked for SFT step {step} but the warm start's next step is "
                f"{self.warm_start_step} (steps are trained in order)"
            )
        failpoint("trainer.sft_step", step)  # dies mid warm start (kill test)
        rows, seq = np.shape(tokens)
        self.levels.check(rows, seq, self.config.trainer.max_seq_len)
        packed, packing = self._layout(loss_mask, chunks=self.levels.num_updates)
        tokens = self._place_rows(tokens, jnp.int32)
        targets = self._place_rows(targets, jnp.int32)
        loss_mask = self._place_rows(loss_mask, jnp.float32)
        first = self._first_of_shape("SFT step", rows, seq)
        start, compiled = time.perf_counter(), perf.compile_seconds()
        with use_mesh(self.mesh, self.rules):
            self._params, self._sft_opt_state, metrics = self._sft_step(
                self._params, self._sft_opt_state, tokens, targets, loss_mask, *packed
            )
            metrics = {k: float(v) for k, v in {**jax.device_get(metrics), **packing}.items()}
        if first:
            seconds = time.perf_counter() - start
            self.progress(f"SFT step {rows}x{seq}: compiled and ran in {seconds:.1f}s")
        compile_s = perf.compile_seconds() - compiled
        step_s = time.perf_counter() - start
        metrics.update(self._speed(rows * seq, step_s, compile_s, metrics.get("model_tokens")))
        self.warm_start_step = step + 1
        last = self.warm_start_step == total
        every = self.config.trainer.warm_start.checkpoint_every
        result = StepResult(step=step, version=0 if last else -1, metrics=metrics)
        self._sft_results[step] = result
        self._last_metrics = metrics
        if last:
            _log.info("SFT warm start done (%d steps): publishing version 0", total)
            self._save_warm_start(wait=False)  # its result: the warm start is never redone
            self._start_rl()
            self._sft_results = {}
            self._publish(0)
        elif every and self.warm_start_step % every == 0:
            self._save_warm_start(wait=False)  # a crash from here loses < `every` steps
        return result

    def _first_of_shape(self, program: str, rows: int, seq: int) -> bool:
        """Whether `program` runs on a batch of this shape for the first time here (so it
        compiles); says so through `progress` if it does."""
        if (program, rows, seq) in self._compiled:
            return False
        self._compiled.add((program, rows, seq))
        self.progress(f"compiling the {program} for batches of {rows}x{seq} tokens ...")
        return True

    def _speed(
        self, tokens: int, step_s: float, compile_s: float, model_tokens: float | None = None
    ) -> dict[str, float]:
        """The step's figures: its wall time, the part of it spent compiling, and throughput
        (the batch's padded tokens) and MFU (of `model_tokens`, the tokens the model runs for
        the sequences: packed rows count no padding and a shared prompt once; default
        `tokens`) over the rest (a first step's compile is not its speed)."""
        if self._peak_flops is None:
            self._peak_flops = perf.matmul_peak_flops(self.mesh, self.config.model.dtype)
        run_s = max(step_s - compile_s, 1e-9)
        model_tokens = tokens if model_tokens is None else model_tokens
        return {
            "time/step_s": step_s,
            "time/compile_s": compile_s,
            "tokens_per_s": tokens / run_s,
            "model_tokens": model_tokens,
            "mfu": perf.mfu(
                train_flops(self.num_params, model_tokens, self.programs.num_trainable),
                run_s,
                self._peak_flops,
            ),
        }

    def _finish(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        tokens: int,
        step_s: float,
        compile_s: float,
        digest: str,
    ):
        metrics.update(self._speed(tokens, step_s, compile_s, metrics.get("model_tokens")))
        self.step = step + 1
        if self._keeps_reference and reference_reset_due(self.config.trainer.algorithm, self.step):
            _log.info("resetting the reference policy to version %d", self.step)
            self._reference = self._reference_copy()
        result = StepResult(step=step, version=self.step, metrics=metrics, batch_digest=digest)
        self._results[step] = result
        self._trained_here = True
        self._last_metrics = metrics
        t_publish = time.perf_counter()
        self._publish(self.step, background=True)
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
            state["reference"] = self.programs.abstract_trainable
        return state

    def save(self, *, wait: bool = True) -> int:
        """Checkpoint the current version (async unless `wait`); returns its step. During
        the SFT warm start it checkpoints the warm start instead (and returns 0)."""
        self._require_state()
        self._wait_sent()  # co-located: a checkpoint's version is on the parameter server
        if self.warm_start_step < self.warm_start_steps:
            self._save_warm_start(wait=wait)
            return self.step
        self._send_needed()
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
        """Load the newest valid checkpoint (or `step`) onto this trainer's mesh.

        A trainer already past `step` that holds the result of every step since (a restarted
        controller reattaching to it) keeps its state instead: the controller goes on from
        `step`, and the steps from there to this trainer's are answered from their records,
        as a repeated TrainStep is; retraining them from the checkpoint would give the same
        weights."""
        self._wait_sent()
        if step is not None:
            failpoint("trainer.restore", step)  # the controller's Restore (chaos test)
        if step is not None and self._reattaches(step):
            self.progress(
                f"kept its state at step {self.step} instead of restoring checkpoint {step}: "
                f"steps {step}..{self.step - 1} are answered from their records"
            )
            return step
        which = "the newest checkpoint" if step is None else f"the checkpoint of step {step}"
        self.progress(f"restoring {which} from {self.checkpoints.directory} ...")
        t0 = time.perf_counter()
        try:
            restored = self.checkpoints.restore(self._abstract_state(), step)
        except NoValidCheckpointError:
            raise
        self.progress(
            f"restored the checkpoint of step {restored.step} from "
            f"{self.checkpoints.directory} in {time.perf_counter() - t0:.1f}s"
        )
        state = restored.state
        self._params = state["params"]
        self._opt_state = state["opt_state"]
        self._reference = state.get("reference")
        self._base_digest = None
        self._sft_opt_state, self._sft_results = None, {}
        self.warm_start_step = self.warm_start_steps  # an RL checkpoint follows the warm start
        self.step = restored.step
        self._trained_here = False
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

    def _reattaches(self, step: int) -> bool:
        """Whether `restore(step)` may keep this trainer's state (see `restore`): it is past
        `step` with every result since, or at `step` having trained here (a trainer that
        only initialized restores, so a missing checkpoint is still reported)."""
        if self._params is None or self.warm_start_step < self.warm_start_steps:
            return False
        if step == self.step:
            return self._trained_here
        return step < self.step and all(s in self._results for s in range(step, self.step))

    def _save_warm_start(self, *, wait: bool) -> None:
        """Checkpoint the warm start's params and optimizer state at its next step."""
        k = self.warm_start_step
        if k == 0 or k in self.warm_start_checkpoints.steps():
            if wait:
                self.warm_start_checkpoints.wait()
            return
        state = {"params": self._params, "opt_state": self._sft_opt_state}
        meta = {"warm_start_step": k, "config_digest": self.config.digest()}
        self.warm_start_checkpoints.save(k, state, meta, wait=wait)
        _log.info("warm-start checkpoint at SFT step %d %s", k, "written" if wait else "started")

    def _restore_warm_start(self) -> bool:
        """Continue the warm start from its newest valid checkpoint; False if there is none
        (it then starts over: the same steps give the same version 0)."""
        if not self.warm_start_checkpoints.steps(reload=True):
            return False
        abstract = {"params": self._abstract_params, "opt_state": self._abstract_sft_opt}
        directory = self.warm_start_checkpoints.directory
        self.progress(f"restoring the SFT warm start from {directory} ...")
        t0 = time.perf_counter()
        try:
            restored = self.warm_start_checkpoints.restore(abstract)
        except NoValidCheckpointError as e:
            _log.warning("no warm-start checkpoint loads (%s); the warm start starts over", e)
            return False
        self.progress(
            f"restored the SFT warm start at step {restored.step} of {self.warm_start_steps} "
            f"from {directory} in {time.perf_counter() - t0:.1f}s"
        )
        self._params = restored.state["params"]
        self._sft_opt_state = restored.state["opt_state"]
        self._sft_results = {}
        self.warm_start_step = restored.step
        self.step = 0
        self._results = {}
        _log.info(
            "restored the SFT warm start at step %d of %d", restored.step, self.warm_start_steps
        )
        return True

    def close(self) -> None:
        """Wait for pending checkpoint saves and the last publish."""
        self._wait_sent()
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        self.checkpoints.close()
        if self.warm_start_checkpoints is not None:
            self.warm_start_checkpoints.close()
