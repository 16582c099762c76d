#!/usr/bin/env python3
"""End-to-end RL on the demo task: on-policy against one-step and N-step off-policy (and Tunix).

    python tools/bench_e2e.py [--quick] [--rounds R] [--sizes demo,20m] [--json OUT]
                              [--target ACC] [--work-dir DIR]

Two model sizes of one family (configs/tiny_cpu.py: a Llama-style model with a character
tokenizer learning arithmetic with GRPO). "demo" is the demo's model (--quick: a smaller
one), warm-started by SFT, with held-out greedy accuracy measured every few steps; "20m"
is a ~20M-parameter model of the same family on the same task, for throughput only (a
one-step warm start, a few steps, no evaluations). For each size the whole job (launcher,
parameter server, trainer, inference workers, verifiers, controller) runs, from the same
warm start, seed and prompt order, on-policy (η=1, N=0), one-step off-policy (η=1, N=1) and
off-policy (η=1, N=4); then, when the optional `google-tunix` package is importable
(`.venv-peer`, built by tools/peer_env.py), Tunix's GRPO learner runs on the same weights
(our model behind Tunix's transformer interface), prompts, group size, batch and lengths,
on-policy. That sequence is one round; R rounds run interleaved (A B C T, A B C T, ...) so
that a noisy host slows every contender alike, and every figure is the median over rounds
with its min-max, every ratio the median of the per-round ratios. Each mode also reports
its step's compute (generation + the jitted update) against the rest (overhead), and its
model FLOPs utilisation (MFU: a step's analytic FLOPs at its rate over the measured matmul
peak).
docs/controller.md ("End-to-end benchmark") explains the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlax_tpu.config import RunConfig, StalenessConfig, load_config  # noqa: E402
from rlax_tpu.config.checkpoint import SHAPE_FIELDS  # noqa: E402
from rlax_tpu.config.run import leave_out_added  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402

# name: (η = reload_every, N = max_staleness)
MODES = {
    "on_policy": (1, 0),
    "one_step": (1, 1),
    "off_policy": (1, 4),
    "on_policy_colocated": (1, 0),
}
# Modes run with inference.colocated: the worker inside the trainer's process.
COLOCATED = ("on_policy_colocated",)
LABELS = {
    "on_policy": "on-policy N=0",
    "one_step": "one-step N=1",
    "off_policy": "off-policy N=4",
    "on_policy_colocated": "co-located N=0",
}
# Steps whose time counts as warm-up (compiles of the trainer and workers) in steps/s.
WARMUP_STEPS = 2
# The warm start's trainer checkpoint: a run directory holding it starts RL from its version 0
# (the trainer does not redo the warm start); its HF export sft_model/ is for the peers.
WARM_START_FILES = ("tokenizer", "data", "checkpoints_warm_start")
# A step's parts (step_ms): the controller's view, then the trainer's own.
STEP_PARTS = {
    "controller_step": "time/controller_step_s",
    "worker_load": "time/worker_load_s",
    "worker_generate": "time/worker_generate_s",
    "verify_assemble": "time/verify_assemble_s",
    "train_step_call": "time/train_step_call_s",
    "trainer_jitted_step": "train/time/step_s",
    "trainer_recompute": "train/time/recompute_s",
    "trainer_publish": "train/time/publish_s",
    # Co-located: the hand-over of the step's version to the worker within the trainer's
    # step call (TrainStep's load_colocated; the swap itself runs after the reply, before
    # the worker's next request), in the steps that had it; the controller loads nothing.
    "trainer_colocated_handover": "train/time/colocated_handover_s",
}
# A step's compute: generation and the jitted update; the rest of controller_step is overhead.
COMPUTE_PARTS = ("worker_generate", "trainer_jitted_step")

# Full: the demo's own model, SFT warm start and learning rates, fewer RL steps than the
# demo and a held-out evaluation every 5 steps to resolve the time to the target.
# --quick: a smaller model (half the width, two layers) with a shorter warm start.
# (tools/validate_simulator.py rebuilds the demo size's config from these two lists.)
# lr 1e-4, the demo's until 2026-11-28 (it is 5e-5 now, docs/learning.md): the figures in
# docs/controller.md and the Tunix peer's optimizer were measured with it.
QUICK = [
    "trainer.optimizer.learning_rate=1e-4",
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.head_dim=16",
    "trainer.warm_start.steps=600",
    "controller.num_steps=40",
    "controller.eval_every=5",
    "controller.eval_size=128",
]
FULL = [
    "trainer.optimizer.learning_rate=1e-4",
    "controller.num_steps=80",
    "controller.eval_every=5",
    "controller.eval_size=128",
]
DEFAULT_TARGET = {"quick": 0.7, "full": 0.75}

# The 20m size: the demo's family, tokenizer and task at about 19M parameters, where a
# step's compute, not its overhead, dominates. Throughput only: SFT to a useful policy would
# take hours on 2 cores, so the warm start is one SFT step (its checkpoint and HF export
# carry the same initial weights to our runs and to Tunix), and there are no evaluations.
MEASURED_STEPS_20M = 4
SIZE_20M = [
    "model.hidden_size=512",
    "model.intermediate_size=1536",
    "model.num_layers=6",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.head_dim=64",
    # 12 KiB of keys and values a token: 64 MiB holds a batch's 64 sequences of 64 tokens.
    "inference.kv_cache_bytes=67108864",
    "trainer.warm_start.steps=1",
    # Shared prompts (docs/trainer.md): each group's prompt runs once in the update, its 8
    # samples' responses in packed rows of 128 tokens beside it, 8 rows a micro-batch.
    "trainer.tokens_per_row=128",
    "trainer.share_prefixes=true",
    "trainer.micro_batch_size=8",
    f"controller.num_steps={WARMUP_STEPS + MEASURED_STEPS_20M}",
    "controller.eval_dataset=",
]
SIZES = ("demo", "20m")

# A step's model FLOPs against the peak (a mode's, and Tunix's); medians of these are not
# rounded (an MFU of a few per cent would lose its digits).
MFU_FIGURES = ("model_flops_per_step", "model_flops_per_s", "peak_flops", "mfu", "trainer_mfu")
# A mode's figures summarised as medians over rounds; "not reached" (None) counts as
# slower than any time for the target figures.
MEDIAN_FIGURES = (
    "steps_per_s",
    "steps_per_s_wall",
    "wall_s",
    "eval_s",
    "initial_accuracy",
    "final_accuracy",
    "staleness_mean",
    "trainer_idle_fraction",
    "worker_idle_fraction",
    "reward_mean_last_10",
    "compute_ms",
    "overhead_ms",
    "step_vs_compute",
    "publish_load_ms",
    *MFU_FIGURES,
)
TARGET_FIGURES = ("time_to_target_s", "time_to_target_excl_eval_s", "steps_to_target")
# Ratios between contenders, formed per round; a size reports the median over rounds.
RATIOS = (
    "speedup_vs_tunix",
    "speedup_off_vs_tunix",
    "speedup_colocated_vs_tunix",
    "speedup_colocated_vs_on",
    "overhead_fraction_on_policy",
    "overhead_fraction_colocated",
    "speedup_off_vs_on",
    "speedup_one_step_vs_on",
    "speedup_off_vs_on_excl_eval",
    "accuracy_delta_off_vs_on",
)


def bench_config(size: str, quick: bool, workers: int, extra: list[str]) -> RunConfig:
    """The config of `size` ("demo": QUICK or FULL; "20m": SIZE_20M), then `extra`."""
    base = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    own = SIZE_20M if size == "20m" else QUICK if quick else FULL
    return base.apply_overrides([*own, f"inference.num_workers={workers}", *extra])


def num_params(config: RunConfig) -> int:
    """Parameters of the config's model (the simulator's count of the Transformer's tree)."""
    from rlax_tpu.simulator.model import count_params

    return count_params(config.model)


# -- the shared SFT warm start -------------------------------------------------------------------
def warm_start_key(config: RunConfig) -> str:
    """What the warm start depends on (model, SFT settings, data, seed, trainer shape)."""
    c, w = config.controller, config.trainer.warm_start
    parts = {
        "seed": config.seed,
        "model": config.model.to_dict(),
        "trainer": config.trainer.to_dict(),
        # as configs wrote them before fields were added (a cached warm start is found)
        "datasets": leave_out_added(config.to_dict())["controller"]["datasets"],
        "eval_dataset": c.eval_dataset,
        "sft": [w.steps, w.learning_rate, c.prompts_per_batch, c.samples_per_prompt],
    }
    rl_only = (
        "algorithm",
        "behaviour_logprobs",
        "checkpoint_every",
        "warm_start",
        "share_prefixes",
    )
    for field in rl_only:
        parts["trainer"].pop(field)  # SFT has its own rate and checkpoint interval
    parts["trainer"]["optimizer"].pop("learning_rate")
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(config: RunConfig, work: Path, log: Path) -> tuple[Path, float, bool]:
    """SFT once into work/warm_start-<key>, reused when it is there: (its dir, seconds,
    whether it was reused)."""
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.launch import job

    directory = work / f"warm_start-{warm_start_key(config)}"
    config = dataclasses.replace(
        config, storage=dataclasses.replace(config.storage, run_dir=str(directory))
    )
    reused = (directory / job.SFT_MODEL_DIR / "config.json").exists()
    t0 = time.perf_counter()
    effective = job.materialise(config)
    tokenizer = Tokenizer.load(job.tokenizer_path(effective))
    with open(log, "a") as out, contextlib.redirect_stdout(out):
        job.warm_start(effective, tokenizer)
    return directory, time.perf_counter() - t0, reused


# -- one mode: the whole job, from the warm start ------------------------------------------------
def same_work(config: RunConfig) -> RunConfig:
    """`config` doing the work Tunix's loop does: no π_old recompute for the mismatch
    diagnostic (trainer.recompute_every) and no checkpoint during the run (Tunix's saves
    none; ours saves the final one, after the last measured step). Neither changes the
    weights (both are resumable fields)."""
    return config.apply_overrides(
        ["trainer.recompute_every=0", f"trainer.checkpoint_every={config.controller.num_steps + 1}"]
    )


def run_mode(
    config: RunConfig,
    name: str,
    warm: Path,
    work: Path,
    log: Path,
    target: float | None,
    peak_flops: float | None = None,
) -> dict:
    """`name` in a fresh run directory work/<name> holding a copy of the warm start; the
    job's output goes to `log`. Returns its figures (MFU against `peak_flops`)."""
    from rlax_tpu.launch import job

    eta, n = MODES[name]
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a left-over run dir would resume
    run_dir.mkdir(parents=True)
    for item in WARM_START_FILES:
        shutil.copytree(warm / item, run_dir / item)
    config = dataclasses.replace(
        same_work(config),
        name=f"bench_e2e_{name}",
        staleness=StalenessConfig(reload_every=eta, max_staleness=n),
        storage=dataclasses.replace(config.storage, run_dir=str(run_dir)),
        inference=dataclasses.replace(config.inference, colocated=name in COLOCATED),
    )
    with open(log, "w") as out, contextlib.redirect_stdout(out):
        summary = job.run(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return figures(summary, rows, target, config, peak_flops)


def compute_split(step_ms: dict[str, float]) -> dict[str, float | None]:
    """A step's compute (generation + the jitted update) and the rest of the controller's
    step (overhead), in ms, from the step_ms medians, and the version hand-off (the
    trainer's publish + the worker's load, by the controller's call or, co-located, within the
    trainer's step call); None when a part was not measured."""
    handoff = [step_ms.get("trainer_publish"), step_ms.get("worker_load")]
    publish_load = None
    if None not in handoff:
        publish_load = round(sum(handoff) + step_ms.get("trainer_colocated_handover", 0.0), 1)
    step = step_ms.get("controller_step")
    parts = [step_ms.get(p) for p in COMPUTE_PARTS]
    if step is None or None in parts or sum(parts) <= 0:
        return {
            "compute_ms": None,
            "overhead_ms": None,
            "step_vs_compute": None,
            "publish_load_ms": publish_load,
        }
    compute = sum(parts)
    return {
        "compute_ms": round(compute, 1),
        "overhead_ms": round(step - compute, 1),
        "step_vs_compute": round(step / compute, 3),
        "publish_load_ms": publish_load,
    }


def figures(
    summary: dict,
    rows: list[dict],
    target: float | None,
    config: RunConfig | None = None,
    peak_flops: float | None = None,
) -> dict:
    """A mode's figures from the controller's summary and its metrics.jsonl rows (one run)
    of `config` (None: no MFU figures), MFU against `peak_flops`.

    Step s's row has elapsed_s taken just before the evaluation at s (if any); the summary's
    eval_elapsed_s[s] is when that evaluation finished, so their difference is its length.
    With no target (or no evaluations) the target and accuracy figures are None.
    """
    rows = [r for r in rows if "reward_mean" in r]  # training steps (not the step-0 eval)
    elapsed = {r["step"]: r["elapsed_s"] for r in rows}
    evals = {int(s): a for s, a in summary["evals"].items()}
    finished = {int(s): t for s, t in summary["eval_elapsed_s"].items()}
    eval_s = {s: finished[s] - elapsed.get(s, 0.0) for s in finished}
    steps = summary["end_step"] - summary["start_step"]
    last = max(elapsed)
    # Warm training throughput: steps after the warm-up, evaluations taken out.
    warm = elapsed[last] - elapsed[WARMUP_STEPS]
    warm -= sum(d for s, d in eval_s.items() if WARMUP_STEPS <= s < last)
    steps_per_s = round((last - WARMUP_STEPS) / warm, 3)
    reached = [s for s in sorted(evals) if target is not None and evals[s] >= target]
    first = reached[0] if reached else None
    # Medians over the warm steps, in ms: where a step's time goes (docs/controller.md).
    step_ms = {
        name: round(1e3 * statistics.median(values), 1)
        for name, key in STEP_PARTS.items()
        if (values := [r[key] for r in rows[WARMUP_STEPS:] if key in r])
    }
    return {
        "steps": steps,
        "steps_per_s": steps_per_s,
        "steps_per_s_wall": round(summary["steps_per_s"], 3),
        "wall_s": round(summary["wall_s"], 1),
        "eval_s": round(sum(eval_s.values()), 1),
        "time_to_target_s": None if first is None else round(finished[first], 1),
        "time_to_target_excl_eval_s": (
            None
            if first is None
            else round(finished[first] - sum(d for s, d in eval_s.items() if s <= first), 1)
        ),
        "steps_to_target": first,
        "initial_accuracy": evals.get(0),
        "final_accuracy": evals[max(evals)] if evals else None,
        "evals": {str(s): evals[s] for s in sorted(evals)},
        "staleness_mean": round(summary["staleness_mean"], 3),
        "trainer_idle_fraction": round(summary["trainer_idle_fraction"], 3),
        "worker_idle_fraction": round(summary["worker_idle_fraction"], 3),
        "reward_mean_last_10": round(statistics.mean(r["reward_mean"] for r in rows[-10:]), 3),
        "step_ms": step_ms,
        **compute_split(step_ms),
        **mode_mfu(rows[WARMUP_STEPS:], config, steps_per_s, peak_flops),
    }


# -- model FLOPs utilisation ---------------------------------------------------------------------
def update_flops(row: dict, config: RunConfig) -> float | None:
    """The jitted update's model FLOPs in a metrics row, as the trainer counts them: the
    tokens the model runs for the sequences (train/model_tokens: packed rows count no
    padding and a shared prompt once; in rows without it, train/tokens_per_s × the step's
    time less its compile) through `train_flops` with the model's parameters (LoRA: its
    adapters trained); None without those figures."""
    from rlax_tpu.simulator.model import lora_params
    from rlax_tpu.trainer.step import train_flops

    keys = ("train/tokens_per_s", "train/time/step_s", "train/time/compile_s")
    if any(key not in row for key in keys):
        return None
    tokens = row.get("train/model_tokens", row[keys[0]] * (row[keys[1]] - row[keys[2]]))
    trained = lora_params(config.model) if config.model.lora is not None else None
    return train_flops(num_params(config), tokens, trained)


def step_flops(rows: list[dict], config: RunConfig) -> float | None:
    """A step's model FLOPs, the mean over `rows` (metrics rows): the update's
    (`update_flops`) and generation's, response_tokens × `decode_flops_per_token` at a mean
    context of the config's expected prompt length plus half the batch's mean response (the
    simulator's); None when a row lacks the trainer's figures."""
    from rlax_tpu.simulator.model import decode_flops_per_token

    prompt = config.inference.length_distributions()[0].mean()
    batch = config.controller.global_batch_size
    per_step = []
    for row in rows:
        update = update_flops(row, config)
        if update is None:
            return None
        tokens = row["response_tokens"]
        context = prompt + tokens / batch / 2
        per_step.append(update + tokens * decode_flops_per_token(config.model, context))
    return statistics.mean(per_step) if per_step else None


def per_step_mfu(
    flops: float | None, steps_per_s: float | None, peak_flops: float | None
) -> dict[str, float | None]:
    """The MFU figures of steps of `flops` model FLOPs at `steps_per_s`: model_flops_per_step,
    model_flops_per_s (their product), peak_flops and mfu (achieved / peak)."""
    from rlax_tpu.trainer import perf

    out = perf.mfu_figures(flops, 1 / steps_per_s if steps_per_s else None, peak_flops)
    return {"model_flops_per_step": out.pop("model_flops"), **out}


def mode_mfu(
    rows: list[dict], config: RunConfig | None, steps_per_s: float, peak_flops: float | None
) -> dict[str, float | None]:
    """A mode's MFU_FIGURES over its warm steps' metrics `rows` (`step_flops` at
    `steps_per_s`, against `peak_flops`) and trainer_mfu, the median of the trainer's own
    train/mfu (its jitted update alone, against its mesh's peak); None where not measured."""
    flops = None if config is None else step_flops(rows, config)
    trainer = [r["train/mfu"] for r in rows if "train/mfu" in r]
    return {
        **per_step_mfu(flops, steps_per_s, peak_flops),
        "trainer_mfu": statistics.median(trainer) if trainer else None,
    }


def tunix_mfu(
    tunix: dict, on_policy: dict | None, peak_flops: float | None
) -> dict[str, float | None]:
    """Tunix's MFU figures: our on-policy step's model FLOPs (it runs the same prompts,
    group size, batch and lengths) at Tunix's steps/s; None without either."""
    flops = None if on_policy is None else on_policy.get("model_flops_per_step")
    return per_step_mfu(flops, tunix.get("steps_per_s"), peak_flops)


# -- Tunix (optional peer) -----------------------------------------------------------------------
def tunix_grpo(config: RunConfig, warm: Path, num_steps: int, log: Path) -> dict:
    """Tunix's GRPO learner on the warm-started weights, on-policy: {steps_per_s, status,
    ...}; figures are None without the package or when the peer fails (its API may drift;
    our figures must not be lost)."""
    result: dict[str, Any] = {"steps_per_s": None, "steps": None, "reward_mean_first_10": None}
    result["reward_mean_last_10"] = None
    if importlib.util.find_spec("tunix") is None:
        return {**result, "status": "not installed (the optional google-tunix package)"}
    try:
        with (
            open(log, "w") as out,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out),
        ):
            figures = _tunix_grpo(config, warm, num_steps)
    except Exception as e:  # noqa: BLE001 - the peer's failure must not lose our figures
        return {**result, "status": f"failed: {type(e).__name__}: {e}"}
    return {**result, **figures, "status": "ok"}


def tunix_model(model):
    """Our Transformer behind Tunix's transformer interface: called with (tokens, positions,
    cache, attention_mask), a dense per-layer cache dict written at `end_index`, attention by
    the mask Tunix passes. (tools/profile_update.py times Tunix's update of it.)"""
    import jax
    from flax import nnx

    from rlax_tpu.models import grouped_attention
    from rlax_tpu.models.transformer import rope_inv_freq

    class Model(nnx.Module):
        def __init__(self, model):
            self.model = model
            self.config = model.config  # num_layers, num_kv_heads, head_dim: Tunix's cache

        def __call__(self, tokens, positions, cache=None, attention_mask=None, **_):
            """tokens, positions: int32[b, t]; attention_mask: bool[b, t, cache or t];
            cache: {"layer_i": {"k", "v": [b, cache, kv, d], "end_index": int32[b]}}."""
            m = self.model
            inv_freq = rope_inv_freq(m.config)
            x = m._embed(tokens)
            new_cache = None if cache is None else {}
            for i, layer in enumerate(m.layers):

                def attend(q, k, v, i=i):
                    if cache is None:
                        return grouped_attention(q, k, v, attention_mask)
                    c = cache[f"layer_{i}"]
                    at = (0, c["end_index"][0], 0, 0)
                    keys = jax.lax.dynamic_update_slice(c["k"], k.astype(c["k"].dtype), at)
                    values = jax.lax.dynamic_update_slice(c["v"], v.astype(c["v"].dtype), at)
                    new_cache[f"layer_{i}"] = {
                        "k": keys,
                        "v": values,
                        "end_index": c["end_index"] + tokens.shape[1],
                    }
                    return grouped_attention(q, keys, values, attention_mask)

                x = m._layer(layer, x, positions, inv_freq, attend)
            return m._logits(m.final_norm(x)), new_cache

    return Model(model)


def _tunix_grpo(config: RunConfig, warm: Path, num_steps: int) -> dict:
    """Our Transformer behind Tunix's transformer interface (a dense per-layer cache dict
    written at `end_index`, attention by the mask Tunix passes), driven by
    `tunix.rl.grpo.grpo_learner.GRPOLearner` on an `RLCluster` whose actor and rollout share
    one mesh of this process's devices (Tunix's colocated, synchronous mode).
    Rewards are our arithmetic verifier's; prompts are drawn as our controller draws them."""
    import jax
    import numpy as np
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from rlax_tpu.data.datasets import PromptMixture
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.launch import job
    from rlax_tpu.models.hf import load_hf_model
    from rlax_tpu.verifiers.tasks import score_arithmetic

    ctl, inf, tr = config.controller, config.inference, config.trainer.optimizer
    groups, samples = ctl.prompts_per_batch, ctl.samples_per_prompt

    tokenizer = Tokenizer.load(str(warm / "tokenizer"))

    class TunixTokenizer:  # no BOS, as our controller encodes prompts
        def encode(self, text, **_):
            return tokenizer.encode(text, add_special_tokens=False)

        def decode(self, ids, **_):
            return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

        def bos_id(self):
            return None

        def eos_id(self):
            return tokenizer.eos_token_id

        def pad_id(self):
            return tokenizer.pad_token_id

    model = tunix_model(load_hf_model(str(warm / "sft_model")))
    devices = np.asarray(jax.devices())
    mesh = jax.sharding.Mesh(devices.reshape(len(devices), 1), ("fsdp", "tp"))
    prompt_len = inf.max_prompt_len
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=inf.max_new_tokens,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + inf.max_new_tokens,
        temperature=inf.temperature,
        top_p=inf.top_p,
        top_k=inf.top_k or None,
        eos_tokens=[tokenizer.eos_token_id],
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=TunixTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.chain(
                    optax.clip_by_global_norm(tr.grad_clip_norm),
                    optax.adam(tr.learning_rate, b1=tr.adam_b1, b2=tr.adam_b2, eps=tr.adam_eps),
                ),
                eval_every_n_steps=10**9,
                max_steps=num_steps,
                mini_batch_size=groups,
                train_micro_batch_size=groups,
            ),
            rollout_config=rollout,
        ),
    )
    rewards: list[float] = []  # every sample's, in order
    rewarded: list[float] = []  # when each reward call came (after that batch's rollouts)

    def arithmetic(prompts, completions, answer, **_):
        rewarded.append(time.perf_counter())
        out = [score_arithmetic(c, str(a)).reward for c, a in zip(completions, answer, strict=True)]
        rewards.extend(out)
        return out

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=samples, num_iterations=1, beta=0.0, epsilon=0.2
        ),
        reward_fns=[arithmetic],
    )
    # The warm start's copy of the training data, drawn in our controller's order.
    at_warm = dataclasses.replace(config.storage, run_dir=str(warm))
    datasets = job.materialise(dataclasses.replace(config, storage=at_warm)).controller.datasets
    mixture = PromptMixture(datasets, seed=config.seed)
    pulled: list[float] = []

    def batches():
        for _ in range(num_steps + 1):
            records = mixture.draw(groups)
            pulled.append(time.perf_counter())  # step k starts when its batch is drawn
            yield {
                "prompts": np.asarray([r.prompt for r in records]),
                "answer": np.asarray([r.reference for r in records]),
            }

    t0 = time.perf_counter()
    learner.train(batches())
    pulled.append(time.perf_counter())  # the end of the last step
    steps = min(num_steps, len(pulled) - 1)
    warm_s = pulled[steps] - pulled[WARMUP_STEPS]
    per_step = [rewards[i : i + groups * samples] for i in range(0, len(rewards), groups * samples)]
    means = [statistics.mean(r) for r in per_step if r]
    # Where a warm step's time goes: batch drawn -> reward call (its rollouts), reward call
    # -> next batch drawn (advantages and the update); meaningful when Tunix scores each
    # batch in one call, as its GRPO learner does.
    one_call_per_step = len(rewarded) == steps
    phases = [
        (rewarded[k] - pulled[k], pulled[k + 1] - rewarded[k])
        for k in range(WARMUP_STEPS, steps if one_call_per_step else 0)
    ]
    return {
        "steps": steps,
        "steps_per_s": round((steps - WARMUP_STEPS) / warm_s, 3),
        "rollout_s": round(statistics.median(g for g, _ in phases), 4) if phases else None,
        "update_s": round(statistics.median(u for _, u in phases), 4) if phases else None,
        "reward_calls": len(rewarded),
        "wall_s": round(time.perf_counter() - t0, 1),
        "reward_mean_first_10": round(statistics.mean(means[:10]), 3) if means else None,
        "reward_mean_last_10": round(statistics.mean(means[-10:]), 3) if means else None,
    }


# -- over rounds ---------------------------------------------------------------------------------
def median(
    values: Sequence[float | None], *, missing_is_slowest: bool = False, digits: int | None = 4
) -> float | None:
    """The median of the values given, rounded to `digits` decimals (None: not rounded);
    None ones are left out, or with `missing_is_slowest` (a target not reached) count as
    infinitely long. None when nothing is left, or when the median itself is a missing one."""
    if missing_is_slowest:
        values = [math.inf if v is None else v for v in values]
    present = [v for v in values if v is not None]
    if not present:
        return None
    mid = statistics.median(present)
    if math.isinf(mid):
        return None
    return mid if digits is None else round(mid, digits)


def spread(values: Sequence[float | None]) -> list[float] | None:
    """[min, max] of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def summarise_mode(rounds: list[dict]) -> dict:
    """One mode's figures over rounds: each figure's median (its min-max in `min_max`), the
    step parts' medians, how many rounds reached the target, and every round's `figures`."""
    out: dict[str, Any] = {"steps": rounds[0]["steps"], "num_rounds": len(rounds)}
    ranges: dict[str, list[float] | None] = {}
    for key in MEDIAN_FIGURES:
        values = [r.get(key) for r in rounds]
        out[key] = median(values, digits=None if key in MFU_FIGURES else 4)
        ranges[key] = spread(values)
    for key in TARGET_FIGURES:
        values = [r.get(key) for r in rounds]
        if key == "steps_to_target":  # a step that was evaluated (an even count has two)
            reached = sorted(math.inf if v is None else v for v in values)
            low = statistics.median_low(reached)
            out[key] = None if math.isinf(low) else low
        else:
            out[key] = median(values, missing_is_slowest=True)
        ranges[key] = spread(values)
    out["target_reached_rounds"] = sum(r.get("time_to_target_s") is not None for r in rounds)
    parts = [p for p in STEP_PARTS if any(p in r["step_ms"] for r in rounds)]
    out["step_ms"] = {p: median([r["step_ms"].get(p) for r in rounds]) for p in parts}
    out["step_ms_min_max"] = {p: spread([r["step_ms"].get(p) for r in rounds]) for p in parts}
    out["min_max"] = ranges
    out["rounds"] = rounds
    return out


def round_ratios(
    modes: dict[str, dict | None], tunix: dict | None, *, by_time_to_target: bool
) -> dict[str, float | None]:
    """The ratios of one round's figures (None where a side is missing).

    speedup_off_vs_on and speedup_one_step_vs_on: on-policy time to target over the other's
    when `by_time_to_target`, else the other's steps/s over on-policy's."""
    on, one, off, co = (
        modes.get(name) for name in ("on_policy", "one_step", "off_policy", "on_policy_colocated")
    )

    def get(mode: dict | None, key: str) -> float | None:
        return None if mode is None else mode.get(key)

    tunix_rate = None if tunix is None else tunix.get("steps_per_s")
    if by_time_to_target:
        off_vs_on = ratio(get(on, "time_to_target_s"), get(off, "time_to_target_s"))
        one_vs_on = ratio(get(on, "time_to_target_s"), get(one, "time_to_target_s"))
        excl = ratio(get(on, "time_to_target_excl_eval_s"), get(off, "time_to_target_excl_eval_s"))
    else:
        off_vs_on = ratio(get(off, "steps_per_s"), get(on, "steps_per_s"))
        one_vs_on = ratio(get(one, "steps_per_s"), get(on, "steps_per_s"))
        excl = None
    on_acc, off_acc = get(on, "final_accuracy"), get(off, "final_accuracy")
    return {
        "speedup_vs_tunix": ratio(get(on, "steps_per_s"), tunix_rate),
        "speedup_off_vs_tunix": ratio(get(off, "steps_per_s"), tunix_rate),
        "speedup_colocated_vs_tunix": ratio(get(co, "steps_per_s"), tunix_rate),
        "speedup_colocated_vs_on": ratio(get(co, "steps_per_s"), get(on, "steps_per_s")),
        "overhead_fraction_on_policy": ratio(get(on, "overhead_ms"), get(on, "compute_ms")),
        "overhead_fraction_colocated": ratio(get(co, "overhead_ms"), get(co, "compute_ms")),
        "speedup_off_vs_on": off_vs_on,
        "speedup_one_step_vs_on": one_vs_on,
        "speedup_off_vs_on_excl_eval": excl,
        "accuracy_delta_off_vs_on": (
            None if on_acc is None or off_acc is None else round(off_acc - on_acc, 4)
        ),
    }


def summarise_tunix(rounds: list[dict]) -> dict:
    """Tunix's figures over rounds (medians of those it has), its status and every round's."""
    out: dict[str, Any] = {
        key: median([r.get(key) for r in rounds])
        for key in ("steps_per_s", "rollout_s", "update_s", "wall_s", "reward_mean_last_10")
    }
    for key in MFU_FIGURES[:-1]:  # trainer_mfu: the trainer's own, not Tunix's
        out[key] = median([r.get(key) for r in rounds], digits=None)
    out["min_max"] = {key: spread([r.get(key) for r in rounds]) for key in ("steps_per_s", "mfu")}
    statuses = [r["status"] for r in rounds]
    if len(set(statuses)) == 1:
        out["status"] = statuses[0]
    else:
        out["status"] = "; ".join(
            f"round {i + 1}: {s}" for i, s in enumerate(statuses) if s != "ok"
        )
    out["rounds"] = rounds
    return out


def size_report(
    config: RunConfig,
    target: float | None,
    mode_rounds: dict[str, list[dict]],
    tunix_rounds: list[dict],
    warm: dict[str, Any],
) -> dict:
    """One size's report: its settings, every mode's summary over rounds (None for a mode
    not run), Tunix's, and each ratio as the median of its per-round values."""
    ctl, model = config.controller, config.model
    num_rounds = len(tunix_rounds)
    modes = {
        name: summarise_mode(mode_rounds[name]) if mode_rounds.get(name) else None for name in MODES
    }
    per_round = [
        round_ratios(
            {name: rounds[r] for name, rounds in mode_rounds.items() if rounds},
            tunix_rounds[r],
            by_time_to_target=target is not None,
        )
        for r in range(num_rounds)
    ]
    tunix = summarise_tunix(tunix_rounds)
    return {
        "num_params": num_params(config),
        "model": {key: getattr(model, key) for key in SHAPE_FIELDS},
        "steps": ctl.num_steps,
        "warmup_steps": WARMUP_STEPS,
        "prompts_per_batch": ctl.prompts_per_batch,
        "samples_per_prompt": ctl.samples_per_prompt,
        "max_new_tokens": config.inference.max_new_tokens,
        "num_workers": config.inference.num_workers,
        "eval_every": ctl.eval_every if ctl.eval_dataset else None,
        "eval_size": ctl.eval_size if ctl.eval_dataset else None,
        "sft_steps": config.trainer.warm_start.steps,
        "sft_s": round(warm["sft_s"], 1),
        "sft_reused": warm["reused"],
        "target_accuracy": target,
        "num_rounds": num_rounds,
        # What speedup_off_vs_on and speedup_one_step_vs_on compare.
        "speedup_basis": "time_to_target" if target is not None else "steps_per_s",
        **modes,
        "tunix": tunix,
        **{key: median([r[key] for r in per_round]) for key in RATIOS},
        "min_max": {key: spread([r[key] for r in per_round]) for key in RATIOS},
        "rounds": per_round,
    }


def report_for(sizes: dict[str, dict], meta: dict[str, Any]) -> dict:
    """The JSON: the demo size's figures under the keys a single-size report has always had
    (tools/validate_simulator.py and the simulator's calibration read them; null when the
    demo size was not run), then every size's report under `sizes`."""
    demo = sizes.get("demo") or {}
    keys = (
        "steps",
        "prompts_per_batch",
        "samples_per_prompt",
        "max_new_tokens",
        "num_workers",
        "eval_every",
        "eval_size",
        "sft_steps",
        "sft_s",
        "sft_reused",
        "target_accuracy",
        *MODES,
        *RATIOS,
    )
    tunix = demo.get("tunix") or {}
    return {
        **meta,
        **{key: demo.get(key) for key in keys},
        "tunix_steps_per_s": tunix.get("steps_per_s"),
        "tunix_status": tunix.get("status"),
        "tunix": demo.get("tunix"),
        "sizes": sizes,
    }


# -- the table ----------------------------------------------------------------------------------
def _show(value: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _cell(value: float | None, bounds: list[float] | None, fmt: str = "{:.2f}") -> str:
    """median [min–max]."""
    if value is None:
        return "n/a"
    if bounds is None or bounds[0] == bounds[1]:
        return _show(value, fmt)
    return f"{_show(value, fmt)} [{_show(bounds[0], fmt)}–{_show(bounds[1], fmt)}]"


def print_table(report: dict) -> None:
    print()
    print(
        f"{report['device']}, {report['num_rounds']} round(s): medians over rounds "
        "[min–max]; a ratio is the median of its per-round values"
    )
    columns = (
        ("steps/s", "steps_per_s", "{:.2f}"),
        ("MFU", "mfu", "{:.2%}"),
        ("compute ms", "compute_ms", "{:.0f}"),
        ("overhead ms", "overhead_ms", "{:.0f}"),
        ("publish+load ms", "publish_load_ms", "{:.1f}"),
        ("step/compute", "step_vs_compute", "{:.2f}"),
        ("to target s", "time_to_target_s", "{:.1f}"),
        ("final acc", "final_accuracy", "{:.3f}"),
    )
    for size, s in report["sizes"].items():
        target = s["target_accuracy"]
        print()
        print(
            f"{size}: {s['num_params'] / 1e6:.2f}M parameters, {s['steps']} RL steps "
            f"({WARMUP_STEPS} warm-up), batch {s['prompts_per_batch']}x"
            f"{s['samples_per_prompt']}, {s['num_workers']} inference worker(s), "
            + (
                f"target held-out accuracy {target:.2f}"
                if target is not None
                else "no evaluations (throughput only)"
            )
        )
        print(f"{'':<16}" + "".join(f"{title:>22}" for title, _, _ in columns))
        for name in MODES:
            m = s[name]
            if m is None:
                print(f"{LABELS[name]:<16}{'(not run)':>22}")
                continue
            cells = [_cell(m[key], m["min_max"][key], fmt) for _, key, fmt in columns]
            if target is not None and 0 < m["target_reached_rounds"] < m["num_rounds"]:
                to_target = [key for _, key, _ in columns].index("time_to_target_s")
                cells[to_target] += f" {m['target_reached_rounds']}/{m['num_rounds']}"
            print(f"{LABELS[name]:<16}" + "".join(f"{c:>22}" for c in cells))
        tunix = s["tunix"]
        rate = _cell(tunix["steps_per_s"], tunix["min_max"]["steps_per_s"])
        mfu = _cell(tunix.get("mfu"), tunix["min_max"].get("mfu"), "{:.2%}")
        print(f"{'tunix GRPO':<16}{rate:>22}{mfu:>22}")
        for name in ("on_policy", "on_policy_colocated"):
            if s[name] is not None:
                step = s[name]["step_ms"]
                parts = ", ".join(f"{k} {v:.1f}" for k, v in step.items() if v is not None)
                print(f"  {LABELS[name]} step, median ms: {parts}")
        if tunix.get("rollout_s") is not None:
            print(
                f"  tunix step, median ms: rollouts {1e3 * tunix['rollout_s']:.0f}, "
                f"update {1e3 * tunix['update_s']:.0f}"
            )
        basis = "time to target" if s["speedup_basis"] == "time_to_target" else "steps/s"
        for key, fmt in (
            ("speedup_vs_tunix", "{:.2f}x"),
            ("speedup_off_vs_tunix", "{:.2f}x"),
            ("speedup_colocated_vs_tunix", "{:.2f}x"),
            ("speedup_colocated_vs_on", "{:.2f}x"),
            ("overhead_fraction_on_policy", "{:.2f}"),
            ("overhead_fraction_colocated", "{:.2f}"),
            ("speedup_off_vs_on", "{:.2f}x"),
            ("speedup_one_step_vs_on", "{:.2f}x"),
            ("accuracy_delta_off_vs_on", "{:+.3f}"),
        ):
            if s[key] is None and key == "accuracy_delta_off_vs_on":
                continue
            n = sum(r[key] is not None for r in s["rounds"])
            note = f" ({basis})" if key in ("speedup_off_vs_on", "speedup_one_step_vs_on") else ""
            print(f"  {key}{note}: {_cell(s[key], s['min_max'][key], fmt)} over {n} round(s)")
        print(f"  tunix: {tunix['status']}")
    print()
    print(
        f"steps/s: warm (after the first {WARMUP_STEPS} steps), held-out evaluations excluded. "
        "compute: median generation + median jitted update; overhead: the median controller "
        "step minus compute (negative when generation overlaps the update); overhead_fraction"
        "_on_policy = on-policy overhead / compute (target <= 0.2). Time to target: from the "
        "start of RL to the end of the first evaluation at or above the target, compiles and "
        "every evaluation included. MFU: a warm step's model FLOPs (the update's 6·N a "
        "trained token, as the trainer counts them, and generation's 2·N + attention a "
        "response token) x steps/s over this process's measured matmul peak (every device, "
        "the model dtype); Tunix's: our on-policy step's FLOPs at its steps/s."
    )


def _progress(size: str, r: int, rounds: int, name: str, m: dict, seconds: float) -> None:
    line = (
        f"[{size} round {r + 1}/{rounds}] {name}: {m['steps']} steps in {seconds:.0f}s, "
        f"{m['steps_per_s']:.2f} steps/s, compute {_show(m['compute_ms'], '{:.0f}')} ms, "
        f"overhead {_show(m['overhead_ms'], '{:.0f}')} ms, MFU {_show(m['mfu'], '{:.2%}')}"
    )
    if m["final_accuracy"] is not None:
        line += (
            f", held-out {_show(m['initial_accuracy'], '{:.3f}')} -> "
            f"{m['final_accuracy']:.3f}, target reached at {m['time_to_target_s']} s"
        )
    print(line, flush=True)


# -- the run ------------------------------------------------------------------------------------
def run_size(
    size: str,
    config: RunConfig,
    target: float | None,
    modes: list[str],
    rounds: int,
    work: Path,
    tunix: bool,
) -> dict:
    """`rounds` rounds of every mode in `modes` then Tunix, each run from the size's warm
    start, under work/<size>/; the size's report."""
    root = work / size
    root.mkdir(parents=True, exist_ok=True)
    ctl = config.controller
    print(
        f"{size}: {num_params(config) / 1e6:.2f}M parameters; SFT warm start "
        f"({config.trainer.warm_start.steps} steps)",
        flush=True,
    )
    warm, sft_s, reused = warm_start(config, work, root / "warm_start.log")
    print(f"warm start {'reused' if reused else 'ready'} in {sft_s:.0f}s: {warm}", flush=True)
    from rlax_tpu.trainer import perf

    # Measured once (cached per dtype), with no job running: what every mode's MFU is over.
    peak_flops = perf.devices_peak_flops(config.model.dtype)
    print(f"matmul peak: {peak_flops / 1e9:.1f} GFLOP/s ({config.model.dtype})", flush=True)
    mode_rounds: dict[str, list[dict]] = {name: [] for name in modes}
    tunix_rounds: list[dict] = []
    # A peer that failed once (its API drifts) fails again: later rounds skip it.
    skip = None if tunix else "skipped (--no-tunix)"
    for r in range(rounds):
        for name in modes:
            t0 = time.perf_counter()
            log = root / f"round{r + 1}-{name}.log"
            m = run_mode(config, name, warm, root, log, target, peak_flops)
            mode_rounds[name].append(m)
            _progress(size, r, rounds, name, m, time.perf_counter() - t0)
        if skip is not None:
            peer = {"steps_per_s": None, "status": skip}
        else:
            peer = tunix_grpo(config, warm, ctl.num_steps, root / f"round{r + 1}-tunix.log")
            if peer["status"] != "ok":
                skip = f"skipped (failed in round {r + 1})"
        on_policy = mode_rounds["on_policy"][r] if "on_policy" in mode_rounds else None
        peer.update(tunix_mfu(peer, on_policy, peak_flops))
        tunix_rounds.append(peer)
        print(
            f"[{size} round {r + 1}/{rounds}] tunix: {peer['status']}, "
            f"{peer.get('steps_per_s')} steps/s",
            flush=True,
        )
    return size_report(
        config, target, mode_rounds, tunix_rounds, {"sft_s": sft_s, "reused": reused}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="the demo size's smaller model and warm start"
    )
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of every mode then Tunix, interleaved (default %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"comma-separated model sizes to run (default: {','.join(SIZES)})",
    )
    parser.add_argument(
        "--target",
        type=float,
        help="held-out accuracy the demo size is to reach (default 0.7 quick, 0.75 full)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="run directories go here (kept; a finished SFT warm start here is reused); "
        "default: a temporary directory, removed at the end unless the run fails",
    )
    parser.add_argument("--workers", type=int, default=1, help="inference workers, every mode")
    parser.add_argument("--no-tunix", action="store_true", help="skip the Tunix peer")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated modes to run (default: all of {','.join(MODES)}); figures "
        "of a mode not run are null",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, every size and mode",
    )
    args = parser.parse_args(argv)
    selected = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(selected) - set(MODES))
    if unknown or not selected:
        parser.error(f"unknown mode(s) {unknown} in --modes: choose from {list(MODES)}")
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown or not sizes:
        parser.error(f"unknown size(s) {unknown} in --sizes: choose from {list(SIZES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    demo_target = (
        args.target
        if args.target is not None
        else DEFAULT_TARGET["quick" if args.quick else "full"]
    )
    configs = {size: bench_config(size, args.quick, args.workers, args.set) for size in sizes}
    for size, config in configs.items():
        if config.controller.num_steps <= WARMUP_STEPS:
            parser.error(
                f"{size}: controller.num_steps={config.controller.num_steps} leaves no step "
                f"after the {WARMUP_STEPS} warm-up steps: set more"
            )
    configure_jax(configs[sizes[0]])  # before anything starts JAX: SFT and Tunix run here

    temporary = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="bench_e2e_")) if temporary else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}", flush=True)
    t_start = time.perf_counter()
    reports = {}
    try:
        for size in SIZES:
            if size in configs:
                target = demo_target if size == "demo" else None
                reports[size] = run_size(
                    size,
                    configs[size],
                    target,
                    selected,
                    args.rounds,
                    work,
                    tunix=not args.no_tunix,
                )
    except BaseException:
        print(f"failed; the run directories and logs are kept in {work}", file=sys.stderr)
        raise
    if temporary:
        shutil.rmtree(work, ignore_errors=True)

    import jax

    report = report_for(
        reports,
        {
            "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
            "cpu_count": os.cpu_count(),
            "quick": args.quick,
            "num_rounds": args.rounds,
            "total_s": round(time.perf_counter() - t_start, 1),
        },
    )
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
