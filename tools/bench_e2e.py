#!/usr/bin/env python3
"""End-to-end RL on the demo task: on-policy against one-step and N-step off-policy (and Tunix).

    python tools/bench_e2e.py [--quick] [--json OUT] [--target ACC] [--work-dir DIR]

The demo (configs/tiny_cpu.py: a tiny Llama-style model with a character tokenizer learning
arithmetic with GRPO) is warm-started by SFT once; then, from the same weights, seed and
prompt order, the whole job (launcher, parameter server, trainer, inference workers,
verifiers, controller) runs three times: on-policy (η=1, N=0), one-step off-policy (η=1,
N=1) and off-policy (η=1, N=4), with held-out greedy accuracy measured every few steps.
Each mode reports steps/s, the wall time to a fixed held-out accuracy, final accuracy,
mean staleness of the rollouts trained on, and the fraction of time trainer and inference
workers sit idle. When the optional `google-tunix` package is importable (`.venv-peer`,
built by tools/peer_env.py), Tunix's GRPO learner then runs on the same warm-started
weights (our model behind Tunix's transformer interface), prompts, group size, batch and
lengths, on-policy, and its warm steps/s is compared with ours. docs/controller.md
("End-to-end benchmark") explains the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlax_tpu.config import RunConfig, StalenessConfig, load_config  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402

# name: (η = reload_every, N = max_staleness)
MODES = {"on_policy": (1, 0), "one_step": (1, 1), "off_policy": (1, 4)}
LABELS = {
    "on_policy": "on-policy (η=1, N=0)",
    "one_step": "one-step off-policy (η=1, N=1)",
    "off_policy": "off-policy (η=1, N=4)",
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
}

# Full: the demo's own model, SFT warm start and learning rates, fewer RL steps than the
# demo and a held-out evaluation every 5 steps to resolve the time to the target.
# --quick: a smaller model (half the width, two layers) with a shorter warm start.
QUICK = [
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.head_dim=16",
    "controller.sft_steps=600",
    "controller.num_steps=40",
    "controller.eval_every=5",
    "controller.eval_size=128",
]
FULL = [
    "controller.num_steps=80",
    "controller.eval_every=5",
    "controller.eval_size=128",
]
DEFAULT_TARGET = {"quick": 0.7, "full": 0.75}


def bench_config(quick: bool, workers: int, extra: list[str]) -> RunConfig:
    base = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    overrides = [*(QUICK if quick else FULL), f"inference.num_workers={workers}", *extra]
    return base.apply_overrides(overrides)


# -- the shared SFT warm start -------------------------------------------------------------------
def warm_start_key(config: RunConfig) -> str:
    """What the warm start depends on (model, SFT settings, data, seed, trainer shape)."""
    c = config.controller
    parts = {
        "seed": config.seed,
        "model": config.model.to_dict(),
        "trainer": config.trainer.to_dict(),
        "datasets": [d.to_dict() for d in c.datasets],
        "eval_dataset": c.eval_dataset,
        "sft": [c.sft_steps, c.sft_learning_rate, c.prompts_per_batch, c.samples_per_prompt],
    }
    for rl_only in ("learning_rate", "algorithm", "behaviour_logprobs", "checkpoint_every"):
        parts["trainer"].pop(rl_only)  # SFT has its own rate and checkpoint interval
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(config: RunConfig, work: Path, log: Path) -> tuple[Path, float, bool]:
    """SFT once into work/warm_start-<key>, reused when it is there: (its dir, seconds,
    whether it was reused)."""
    from rlax_tpu.controller import job
    from rlax_tpu.models.tokenizer import Tokenizer

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
def run_mode(config: RunConfig, name: str, warm: Path, work: Path, target: float) -> dict:
    from rlax_tpu.controller import job

    eta, n = MODES[name]
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a left-over run dir would resume
    run_dir.mkdir(parents=True)
    for item in WARM_START_FILES:
        shutil.copytree(warm / item, run_dir / item)
    config = dataclasses.replace(
        config,
        name=f"bench_e2e_{name}",
        staleness=StalenessConfig(reload_every=eta, max_staleness=n),
        storage=dataclasses.replace(config.storage, run_dir=str(run_dir)),
    )
    with open(work / f"{name}.log", "w") as out, contextlib.redirect_stdout(out):
        summary = job.run(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return figures(summary, rows, target)


def figures(summary: dict, rows: list[dict], target: float) -> dict:
    """A mode's figures from the controller's summary and its metrics.jsonl rows.

    Step s's row has elapsed_s taken just before the evaluation at s (if any); the summary's
    eval_elapsed_s[s] is when that evaluation finished, so their difference is its length.
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
    reached = [s for s in sorted(evals) if evals[s] >= target]
    first = reached[0] if reached else None
    return {
        "steps": steps,
        "steps_per_s": round((last - WARMUP_STEPS) / warm, 3),
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
        "final_accuracy": evals[max(evals)],
        "evals": {str(s): evals[s] for s in sorted(evals)},
        "staleness_mean": round(summary["staleness_mean"], 3),
        "trainer_idle_fraction": round(summary["trainer_idle_fraction"], 3),
        "worker_idle_fraction": round(summary["worker_idle_fraction"], 3),
        "reward_mean_last_10": round(statistics.mean(r["reward_mean"] for r in rows[-10:]), 3),
        # Medians over the warm steps, in ms: where a step's time goes (docs/controller.md).
        "step_ms": {
            name: round(1e3 * statistics.median(values), 1)
            for name, key in STEP_PARTS.items()
            if (values := [r[key] for r in rows[WARMUP_STEPS:] if key in r])
        },
    }


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


def _tunix_grpo(config: RunConfig, warm: Path, num_steps: int) -> dict:
    """Our Transformer behind Tunix's transformer interface (a dense per-layer cache dict
    written at `end_index`, attention by the mask Tunix passes), driven by
    `tunix.rl.grpo.grpo_learner.GRPOLearner` on an `RLCluster` whose actor and rollout share
    one mesh of this process's devices (Tunix's colocated, synchronous mode).
    Rewards are our arithmetic verifier's; prompts are drawn as our controller draws them."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from rlax_tpu.controller import job
    from rlax_tpu.controller.datasets import PromptMixture
    from rlax_tpu.models import Transformer, grouped_attention
    from rlax_tpu.models.hf import load_hf_model
    from rlax_tpu.models.tokenizer import Tokenizer
    from rlax_tpu.models.transformer import rope_inv_freq
    from rlax_tpu.verifiers.tasks import score_arithmetic

    ctl, inf, tr = config.controller, config.inference, config.trainer
    groups, samples = ctl.prompts_per_batch, ctl.samples_per_prompt

    class Model(nnx.Module):
        def __init__(self, model: Transformer):
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

    model = Model(load_hf_model(str(warm / "sft_model")))
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


# -- the report ---------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def print_table(report: dict) -> None:
    def show(value, fmt="{:.2f}"):
        return "n/a" if value is None else fmt.format(value)

    def times(value):
        return show(value, "{:.2f}x")

    print()
    print(
        f"demo task, {report['device']}, {report['steps']} RL steps, batch "
        f"{report['prompts_per_batch']}x{report['samples_per_prompt']}, "
        f"{report['num_workers']} inference worker(s), target held-out accuracy "
        f"{report['target_accuracy']:.2f}"
    )
    header = (
        f"{'mode':<32}{'steps/s':>9}{'to target s':>13}{'final acc':>11}{'initial':>9}"
        f"{'staleness':>11}{'trainer idle':>14}{'worker idle':>13}"
    )
    print(header)
    for name in MODES:
        m = report[name]
        if m is None:
            print(f"{LABELS[name]:<32}{'(not run)':>9}")
            continue
        print(
            f"{LABELS[name]:<32}{show(m['steps_per_s']):>9}"
            f"{show(m['time_to_target_s'], '{:.1f}'):>13}{show(m['final_accuracy'], '{:.3f}'):>11}"
            f"{show(m['initial_accuracy'], '{:.3f}'):>9}{show(m['staleness_mean']):>11}"
            f"{show(m['trainer_idle_fraction']):>14}{show(m['worker_idle_fraction']):>13}"
        )
    tunix = report["tunix"]
    print(f"{'tunix GRPO learner (on-policy)':<32}{show(tunix['steps_per_s']):>9}")
    on = report["on_policy"]
    if on is not None:
        ms = on["step_ms"]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in ms.items())
        print(f"on-policy step, median ms: {parts}")
    if tunix.get("rollout_s") is not None:
        print(
            f"tunix step, median ms: rollouts {1e3 * tunix['rollout_s']:.0f}, "
            f"update {1e3 * tunix['update_s']:.0f}"
        )
    print(
        f"speedup vs on-policy (time to target): off-policy {times(report['speedup_off_vs_on'])}, "
        f"one-step {times(report['speedup_one_step_vs_on'])}; final accuracy off - on: "
        f"{show(report['accuracy_delta_off_vs_on'], '{:+.3f}')}"
    )
    print(
        f"speedup vs tunix (on-policy steps/s): {times(report['speedup_vs_tunix'])}; "
        f"tunix: {report['tunix_status']}"
    )
    print(
        "steps/s: warm (after the first "
        f"{WARMUP_STEPS} steps), held-out evaluations excluded. Time to target: seconds from "
        "the start of RL to the end of the first evaluation at or above the target, compiles "
        "and every evaluation (every "
        f"{report['eval_every']} steps, {report['eval_size']} prompts, greedy) included; "
        "idle fractions over the same wall time."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a few minutes)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument(
        "--target", type=float, help="held-out accuracy to reach (default 0.7 quick, 0.75 full)"
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
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args(argv)
    selected = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(selected) - set(MODES))
    if unknown or not selected:
        parser.error(f"unknown mode(s) {unknown} in --modes: choose from {list(MODES)}")
    target = (
        args.target
        if args.target is not None
        else DEFAULT_TARGET["quick" if args.quick else "full"]
    )
    config = bench_config(args.quick, args.workers, args.set)
    configure_jax(config)  # before anything starts JAX: the SFT and Tunix run in-process

    temporary = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="bench_e2e_")) if temporary else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        print(f"work dir {work}; SFT warm start ({config.controller.sft_steps} steps)", flush=True)
        warm, sft_s, reused = warm_start(config, work, work / "warm_start.log")
        print(f"warm start {'reused' if reused else 'ready'} in {sft_s:.0f}s: {warm}", flush=True)
        modes: dict[str, dict | None] = dict.fromkeys(MODES)
        for name in selected:
            t0 = time.perf_counter()
            modes[name] = run_mode(config, name, warm, work, target)
            m = modes[name]
            print(
                f"{name}: {m['steps']} steps in {time.perf_counter() - t0:.0f}s, "
                f"{m['steps_per_s']:.2f} steps/s, held-out {m['initial_accuracy']:.3f} -> "
                f"{m['final_accuracy']:.3f}, target reached at {m['time_to_target_s']} s",
                flush=True,
            )
        if args.no_tunix:
            tunix = {"steps_per_s": None, "status": "skipped (--no-tunix)"}
        else:
            tunix = tunix_grpo(config, warm, config.controller.num_steps, work / "tunix.log")
        print(f"tunix: {tunix['status']}, {tunix.get('steps_per_s')} steps/s", flush=True)
    except BaseException:
        print(f"failed; the run directories and logs are kept in {work}", file=sys.stderr)
        raise
    if temporary:
        shutil.rmtree(work, ignore_errors=True)

    import jax

    on, one, off = modes["on_policy"], modes["one_step"], modes["off_policy"]

    def get(mode: dict | None, key: str) -> float | None:
        return None if mode is None else mode[key]

    ctl = config.controller
    report = {
        "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "cpu_count": os.cpu_count(),
        "quick": args.quick,
        "steps": ctl.num_steps,
        "prompts_per_batch": ctl.prompts_per_batch,
        "samples_per_prompt": ctl.samples_per_prompt,
        "max_new_tokens": config.inference.max_new_tokens,
        "num_workers": config.inference.num_workers,
        "eval_every": ctl.eval_every,
        "eval_size": ctl.eval_size,
        "sft_steps": ctl.sft_steps,
        "sft_s": round(sft_s, 1),
        "sft_reused": reused,
        "target_accuracy": target,
        "on_policy": on,
        "one_step": one,
        "off_policy": off,
        "speedup_off_vs_on": ratio(get(on, "time_to_target_s"), get(off, "time_to_target_s")),
        "speedup_one_step_vs_on": ratio(get(on, "time_to_target_s"), get(one, "time_to_target_s")),
        "speedup_off_vs_on_excl_eval": ratio(
            get(on, "time_to_target_excl_eval_s"), get(off, "time_to_target_excl_eval_s")
        ),
        "accuracy_delta_off_vs_on": (
            None
            if on is None or off is None
            else round(off["final_accuracy"] - on["final_accuracy"], 4)
        ),
        "tunix_steps_per_s": tunix["steps_per_s"],
        "speedup_vs_tunix": ratio(get(on, "steps_per_s"), tunix["steps_per_s"]),
        "tunix_status": tunix["status"],
        "tunix": tunix,
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
