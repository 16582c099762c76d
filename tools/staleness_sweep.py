#!/usr/bin/env python3
"""How robust is each RL objective to stale rollouts? The demo task at N = 0 and N = 16.

    python tools/staleness_sweep.py [--quick] [--json STUDY.json] [--plot OUT.png]
        [--steps N] [--work-dir DIR] [--algorithms a,b] [--staleness 0,16] [--seeds 0-9]
        [--set key=value ...]

Per seed, the demo (configs/tiny_cpu.py: sums and differences of numbers to 99, judged on
held-out problems no training row holds) is warm-started by SFT once; then, from those
weights, with that seed's prompt order and sampling, the whole job
(`rlax_tpu.launch.job.run`: launcher, parameter server, trainer, inference worker,
verifiers, controller) runs an RL phase for each objective and each acceptance staleness N
(η = 1, deterministic schedule: batch b is generated with version max(0, b − N)). The runs
of a seed are paired: the same warm start and prompt order at every N, so Δacc = acc(N=16)
− acc(N=0) is a difference within a seed, and its mean over seeds has a bootstrap 95 %
interval (seeds resampled).

Objectives: the presets GRPO, Dr. GRPO, AIPO, trajectory balance, online DPO (as
published, docs/algorithms.md), GRPO variants (dual clip c = 3; TIS over a recomputed π_old),
and the seed papers' conditions: TB as TBA runs it (β for a reward scale of a few nats,
TBA's replay buffer, the reference reset), TBA-PRIME, online DPO with 4 or 2 samples per
prompt and with a graded reward (tools/graded_arithmetic.py) so that its best and worst
samples do not tie. Importance weights are taken against the workers' behaviour log-probs
(`trainer.behaviour_logprobs=cached`; the TIS variant's ratio is to the recomputed π_old,
its TIS weight corrects π_old against the workers' π_rollout). Each run records

* final held-out greedy accuracy (the controller's evaluation at the last step) and the SFT
  model's (step 0, the same for every run of a seed);
* the drift between the policy trained and the one that generated its data: the trainer's
  mean |log π_θ − log μ| per response token, averaged over the run's steps (it grows with
  N; Δacc is reported against it as well as against N);
* KL(π_θ ‖ π_ref) of the final policy to the SFT reference, measured the same way for every
  objective: on the held-out prompts, responses are sampled from the final policy
  (temperature 1); along each response the exact KL between the two next-token
  distributions is summed over its tokens, then averaged: nats per response;
* the trainer's own `kl` metric (k3 per token, last steps) where the objective reports one.

--json is the study's record: read first (its runs, keyed by objective, N and seed with
their config digest, are kept and not run again), rewritten after every run, so a study can
be run in parts and extended with more seeds or objectives. It holds every run, the
per-seed Δacc of each objective with its mean and interval, the differences between
objectives paired by seed, a markdown table and a reading that states a difference only
where its interval excludes zero. --plot draws accuracy and KL against N (needs
matplotlib: `pip install -e .[plots]`). `--quick` is a smoke test: 2 objectives x 2 values
of N, one seed, a smaller model, a short warm start and a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlax_tpu.config import (  # noqa: E402
    AlgorithmConfig,
    ImportanceConfig,
    KLConfig,
    ReplayConfig,
    RunConfig,
    StalenessConfig,
    load_config,
)
from rlax_tpu.config.base import unmove_renamed  # noqa: E402
from rlax_tpu.config.run import RENAMED_FIELDS, leave_out_added  # noqa: E402
from rlax_tpu.run_dir import EFFECTIVE_CONFIG  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402

# The compared objectives run 3× longer (LONG_STEPS): at N = 16 the first 16 updates train on
# data of the SFT policy, 20 % of an 80-step run and 7 % of a 240-step one.
LONG = ("grpo_long", "aipo_long", "trajectory_balance_long", "online_dpo_long")
LONG_STEPS = 240
ALGORITHMS = (
    "grpo",
    "dr_grpo",
    "aipo",
    "trajectory_balance",
    "online_dpo",
    "grpo_dual_clip",
    "grpo_tis",
    "tb_reset",
    "tba_prime",
    "online_dpo_k4",
    "online_dpo_k2",
    "tb_tba",
    "online_dpo_graded",
    *LONG,
)
LABELS_OF_PRESETS = {
    "grpo": "GRPO",
    "aipo": "AIPO",
    "trajectory_balance": "TB",
    "online_dpo": "online DPO",
}
LABELS = {
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "aipo": "AIPO",
    "trajectory_balance": "TB",
    "online_dpo": "online DPO",
    "grpo_dual_clip": "GRPO + dual clip",
    "grpo_tis": "GRPO + TIS",
    "tb_reset": "TB + ref. reset",
    "tba_prime": "TBA-PRIME",
    "online_dpo_k4": "online DPO, K=4",
    "online_dpo_k2": "online DPO, K=2",
    "tb_tba": "TB as in TBA",
    "online_dpo_graded": "online DPO, graded reward",
    **{f"{p}_long": f"{LABELS_OF_PRESETS[p]}, {LONG_STEPS} steps" for p in (n[:-5] for n in LONG)},
}
# The graded reward of the online DPO variant (a reward function of your own, by path).
GRADED_REWARD = f"{ROOT / 'tools' / 'graded_arithmetic.py'}:reward"
# The reference reset period ρ of the TBA variants: TBA-PRIME resets every 50 steps of runs
# many times longer than the sweep's 40; every 10 gives the sweep's runs several resets.
TBA_RESET_EVERY = 10
# Variants that are not presets as published: (preset, its overrides, trainer overrides,
# controller overrides).
VARIANTS = {
    "grpo_tis": (
        "grpo",
        {"rollout_correction": "token_tis"},
        {"behaviour_logprobs": "recomputed"},
        {},
    ),
    # The conditions of the seed papers that the published presets lack (docs/data.md):
    # TBA's reference reset π_ref ← π_θ every ρ steps, on trajectory balance ...
    "tb_reset": (
        "trajectory_balance",
        {"kl": KLConfig(reference_reset_every=TBA_RESET_EVERY)},
        {},
        {},
    ),
    # ... and TBA-PRIME (TBA Eq. 16): Σ_t sg(min(λ_t, 8)·(r − r̄ − β(log Λ − mean log Λ)))
    # ·∇log π_θ(y_t), λ_t = π_θ/μ per token, log Λ = Σ_t log π/π_ref, β = 0.005, the reference
    # reset every ρ steps. In parts: AIPO's truncated token weight at 8 (sequence sum, keep
    # all) on the group-mean advantage of a reward with the k1 KL folded in (which reads
    # π_old, here the behaviour policy, where TBA reads π_θ).
    "tba_prime": (
        "aipo",
        {
            "importance": ImportanceConfig(rho_max=8.0),
            "kl_estimator": "k1",
            "kl": KLConfig(
                beta=0.005,
                beta_final=0.005,
                in_reward=True,
                reference_reset_every=TBA_RESET_EVERY,
            ),
        },
        {},
        {},
    ),
    # Noukhovitch et al.'s online DPO draws 2 samples per prompt (TL;DR), or takes the best
    # and worst of 4 (GSM8K); the preset's β = 0.1 is theirs. The global batch stays 64.
    "online_dpo_k4": ("online_dpo", {}, {}, {"prompts_per_batch": 16, "samples_per_prompt": 4}),
    "online_dpo_k2": ("online_dpo", {}, {}, {"prompts_per_batch": 32, "samples_per_prompt": 2}),
    # Trajectory balance as TBA runs it: β constant at 0.3, so a right answer is worth
    # r/β ≈ 3 nats (the preset's β = 0.012 makes it 83: the squared residual is then the
    # reward alone); TBA's replay buffer, drawing a prompt with probability m = 0.5 from the
    # latest sync and else by reward (TBA's m for its TL;DR and red-teaming runs); and the
    # reference reset every ρ steps.
    "tb_tba": (
        "trajectory_balance",
        {
            "kl": KLConfig(
                beta=0.3, beta_final=0.3, beta_decay_steps=0, reference_reset_every=TBA_RESET_EVERY
            ),
        },
        {},
        {"replay": ReplayConfig(enabled=True, recency_prob=0.5)},
    ),
    # Online DPO with partial credit by distance to the answer (tools/graded_arithmetic.py):
    # with the task's binary reward the best and worst of a group tie whenever all its
    # samples are right or all wrong.
    "online_dpo_graded": ("online_dpo", {}, {}, {"reward_function": GRADED_REWARD}),
    # More steps (LONG): the same objective and learning rate, 3× the updates.
    **{name: (name[: -len("_long")], {}, {}, {"num_steps": LONG_STEPS}) for name in LONG},
}
STALENESS = (0, 16)
SEEDS = tuple(range(10))
# The comparison the docs draw, with every seed; other presets, variants and N = 4 may run
# with fewer (docs/data.md says which).
COMPARED = (
    "grpo",
    "aipo",
    "trajectory_balance",
    "online_dpo",
    "tb_tba",
    "online_dpo_graded",
)
QUICK_ALGORITHMS = ("grpo", "online_dpo")
QUICK_STALENESS = (0, 4)
QUICK_SEEDS = (0,)
# The warm start's trainer checkpoint: a run directory holding it starts RL from its version 0
# (the trainer does not redo the warm start); its HF export sft_model/ is for the peers.
WARM_START_FILES = ("tokenizer", "data", "checkpoints_warm_start")
# The trainer's per-token |log π_θ − log μ| (metrics.jsonl), averaged over a run: its drift.
DRIFT = "train/logprob_diff/mean"
# Bootstrap resamples of the seeds for the 95 % intervals, from a fixed stream.
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
# Steps whose trainer `kl` metric is averaged.
LAST_STEPS = 5
KL_SAMPLES = 4  # responses per held-out prompt for the KL estimate
KL_SEED = 20250101

# The demo's model, warm start and learning rate (so a seed's warm start is the one
# tools/learning_curves.py makes, shared through a common --work-dir), 80 RL steps: at N = 16
# the first 17 batches come from the SFT model, a fifth of the run (at 40 steps it was
# 40 %). No evaluation between start and end. The importance weight is taken against the
# behaviour policy μ that generated the rollouts (the workers' log-probs), as in the seed
# papers' staleness experiments; with the trainer's default, π_old recomputed at the version
# being trained, a batch trained in one mini-batch has ratio 1 whatever its staleness.
SWEEP = [
    "trainer.behaviour_logprobs=cached",
    "controller.num_steps=80",
    "controller.eval_every=0",
    "controller.eval_size=512",
]
# A smoke test: a smaller model, a short warm start, a few steps.
QUICK = [
    *SWEEP,
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.head_dim=16",
    "trainer.warm_start.steps=200",
    "controller.num_steps=8",
    "controller.eval_size=128",
]


def sweep_config(quick: bool, steps: int | None, extra: Sequence[str]) -> RunConfig:
    overrides = [*(QUICK if quick else SWEEP), *extra]
    if steps is not None:
        overrides.append(f"controller.num_steps={steps}")
    return load_config(str(ROOT / "configs" / "tiny_cpu.py"), overrides)


def algorithm_config(name: str, config: RunConfig) -> AlgorithmConfig:
    """The preset as published (or a VARIANT of one); Dr. GRPO's L is the generation budget
    (docs/algorithms.md)."""
    if name == "dr_grpo":
        return AlgorithmConfig(name=name, max_response_len=config.inference.max_new_tokens)
    if name in VARIANTS:
        preset, overrides, _, _ = VARIANTS[name]
        return AlgorithmConfig(name=preset, **overrides)
    return AlgorithmConfig(name=name)


def run_config(base: RunConfig, algorithm: str, n: int, run_dir: Path) -> RunConfig:
    _, _, trainer_overrides, controller_overrides = VARIANTS.get(algorithm, ("", {}, {}, {}))
    controller_overrides = dict(controller_overrides)
    reward_function = controller_overrides.pop("reward_function", "")
    if reward_function:  # the training rows judged by it; the held-out rows stay exact
        controller_overrides["datasets"] = tuple(
            dataclasses.replace(d, verifier="function", reward_function=reward_function)
            for d in base.controller.datasets
        )
    return dataclasses.replace(
        base,
        name=f"staleness_{algorithm}_n{n}",
        staleness=StalenessConfig(reload_every=1, max_staleness=n),
        trainer=dataclasses.replace(
            base.trainer, algorithm=algorithm_config(algorithm, base), **trainer_overrides
        ),
        controller=dataclasses.replace(base.controller, **controller_overrides),
        storage=dataclasses.replace(base.storage, run_dir=str(run_dir)),
    )


# -- the shared SFT warm start -------------------------------------------------------------------
def warm_start_key(config: RunConfig) -> str:
    """What the warm start depends on: model, SFT settings, data, seed, trainer shape. Read
    from the config's layout before its sections were nested (`unmove_renamed`), so the
    keys of warm starts made before then still find them (a study resumes, not redoes)."""
    c = config.controller
    flat = unmove_renamed(leave_out_added(config.to_dict()), RENAMED_FIELDS)
    trainer = flat["trainer"]
    for field in ("learning_rate", "algorithm", "behaviour_logprobs"):  # RL only
        trainer.pop(field)
    parts = {
        "seed": config.seed,
        "model": flat["model"],  # without fields added since (ADDED_FIELDS at their default)
        "trainer": trainer,
        # The rows, not how RL judges them (the graded variant shares the warm start).
        "datasets": [
            {k: v for k, v in d.items() if k not in ("verifier", "reward_function")}
            for d in flat["controller"]["datasets"]
        ],
        "eval_dataset": c.eval_dataset,
        # its batch: all rows
        "sft": [
            flat["controller"]["sft_steps"],
            flat["controller"]["sft_learning_rate"],
            c.global_batch_size,
        ],
    }
    if c.environment.enabled:  # demonstrations are built as its episodes (Episodes)
        parts["environment"] = c.environment.to_dict()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(config: RunConfig, work: Path) -> Path:
    """SFT once into work/warm_start-<key> (reused when it is there); returns that directory."""
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.launch import job

    directory = work / f"warm_start-{warm_start_key(config)}"
    config = dataclasses.replace(
        config, storage=dataclasses.replace(config.storage, run_dir=str(directory))
    )
    effective = job.materialise(config)
    tokenizer = Tokenizer.load(job.tokenizer_path(effective))
    with open(work / "warm_start.log", "a") as out, contextlib.redirect_stdout(out):
        job.warm_start(effective, tokenizer)
    return directory


def start_from_warm_start(run_dir: Path, warm: Path) -> None:
    """A fresh `run_dir` holding the warm start's trainer checkpoint, tokenizer and data, so
    the job starts RL from its version 0 (a left-over run dir would resume or refuse)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for item in WARM_START_FILES:
        shutil.copytree(warm / item, run_dir / item)


# -- KL of the final policy to the reference -----------------------------------------------------
def final_params(run_dir: Path, like: Any) -> tuple[int, Any]:
    """(version, params) of the newest version the run's parameter server persisted."""
    import numpy as np

    from rlax_tpu.models import lora_base
    from rlax_tpu.param_server.store import VersionStore
    from rlax_tpu.tree import flatten, unflatten_like

    store = VersionStore(str(run_dir / "params"), hot_versions=1)
    version = max(v.version for v in store.versions())
    stored = {piece.path for piece in store.layout()}
    if lora_base.DIGEST_KEY not in stored:
        return version, unflatten_like(like, {p: store.read(version, p) for p in flatten(like)})
    # A LoRA run's version holds its adapters: fold them into the base it names.
    import jax

    from rlax_tpu.models import lora

    effective = RunConfig.from_dict(json.loads((run_dir / EFFECTIVE_CONFIG).read_text()))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
    base_store = lora_base.LoraBaseStore(str(run_dir))
    try:
        digest = lora_base.digest_of_leaf(store.read(version, lora_base.DIGEST_KEY))
        base = flatten(base_store.read(digest, abstract))
    finally:
        base_store.close()
    from flax import nnx

    from rlax_tpu.models import Transformer

    model = nnx.eval_shape(lambda: Transformer(effective.model.served(), rngs=nnx.Rngs(0)))
    adapters_like = lora.split(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    adapters = flatten(lora.unpack(store.read(version, lora.PACKED_KEY), adapters_like))
    whole = unflatten_nested({**base, **adapters})
    folded = flatten(lora.merged(whole, effective.model.lora.scale))
    return version, unflatten_like(like, {p: np.asarray(folded[p]) for p in flatten(like)})


def unflatten_nested(values: dict[str, Any]) -> dict[str, Any]:
    """{"layers/0/attn/wq": x} -> {"layers": {"0": {"attn": {"wq": x}}}} (string keys)."""
    out: dict[str, Any] = {}
    for path, value in values.items():
        *parents, last = path.split("/")
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def sequence_kl(
    policy: Any,
    reference: Any,
    prompts: Sequence[Sequence[int]],
    *,
    samples: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    seed: int,
) -> dict[str, float]:
    """KL(π_θ ‖ π_ref) per response, in nats: `samples` responses per prompt from `policy`
    (temperature 1), the exact per-token KL of the two next-token distributions summed
    along each. Returns its mean over prompts, the standard error of that mean, and the
    mean response length."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    graphdef, policy_state = nnx.split(policy)
    _, reference_state = nnx.split(reference)

    @jax.jit
    def log_probs(state: Any, tokens: jax.Array) -> jax.Array:
        """tokens: int32[rows, seq] -> float32[rows, seq, vocab], next-token log-probs."""
        model = nnx.merge(graphdef, state)
        logits = model.forward_train(tokens, tokens, return_logits=True).logits
        return jax.nn.log_softmax(logits, axis=-1)

    rows = [tuple(p) for p in prompts for _ in range(samples)]
    lengths = np.asarray([len(p) for p in rows])
    seq = 16 * math.ceil((lengths.max() + max_new_tokens) / 16)
    tokens = np.zeros((len(rows), seq), np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    index = np.arange(len(rows))
    alive = np.ones(len(rows), bool)
    generated = np.zeros(len(rows), np.int64)  # response tokens, a stop token included
    key = jax.random.key(seed)
    for j in range(max_new_tokens):
        if not alive.any():
            break
        step = np.asarray(log_probs(policy_state, jnp.asarray(tokens)))[index, lengths + j - 1]
        key, sub = jax.random.split(key)
        sampled = np.asarray(jax.random.categorical(sub, jnp.asarray(step)))
        tokens[index[alive], (lengths + j)[alive]] = sampled[alive]
        generated += alive
        alive &= ~np.isin(sampled, list(stop_token_ids))
    p = np.asarray(log_probs(policy_state, jnp.asarray(tokens)), np.float64)
    r = np.asarray(log_probs(reference_state, jnp.asarray(tokens)), np.float64)
    per_position = (np.exp(p) * (p - r)).sum(-1)  # [rows, seq]
    position = np.arange(seq)[None, :]
    first = (lengths - 1)[:, None]  # position t scores token t + 1
    mask = (position >= first) & (position < first + generated[:, None])
    per_prompt = (per_position * mask).sum(1).reshape(len(prompts), samples).mean(1)
    return {
        "kl": float(per_prompt.mean()),
        "kl_stderr": float(per_prompt.std(ddof=1) / math.sqrt(len(prompts))),
        "response_length": float(generated.mean()),
    }


def kl_to_reference(run_dir: Path, reference_dir: str) -> dict[str, float]:
    """sequence_kl of the run's final version against the SFT export in `reference_dir` (the
    warm start's sft_model/), on the run's held-out prompts."""
    from flax import nnx

    from rlax_tpu.config import DatasetConfig
    from rlax_tpu.data.datasets import load_dataset
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.launch import job
    from rlax_tpu.models.hf import build_model, load_hf_config, load_hf_params

    effective = RunConfig.from_dict(json.loads((run_dir / EFFECTIVE_CONFIG).read_text()))
    model_config = load_hf_config(reference_dir)
    reference_params = load_hf_params(reference_dir, model_config)
    version, policy_params = final_params(run_dir, reference_params)
    reference = build_model(model_config, reference_params, rngs=nnx.Rngs(0))
    policy = build_model(model_config, policy_params, rngs=nnx.Rngs(0))
    tokenizer = Tokenizer.load(job.tokenizer_path(effective))
    ctl = effective.controller
    records = load_dataset(DatasetConfig(path=ctl.eval_dataset))[: ctl.eval_size]
    eos = tokenizer.eos_token_id
    stops = effective.inference.stop_token_ids or ((eos,) if eos is not None else ())
    result = sequence_kl(
        policy,
        reference,
        [tokenizer.encode(r.prompt) for r in records],
        samples=KL_SAMPLES,
        max_new_tokens=effective.inference.max_new_tokens,
        stop_token_ids=stops,
        seed=KL_SEED,
    )
    return {**result, "version": version}


# -- one run ---------------------------------------------------------------------------------------
def cell_digest(base: RunConfig, algorithm: str, n: int, work: Path) -> str:
    """The digest of (algorithm, N)'s run config for `base`'s seed: what a stored result of
    that cell must have been measured with to be reused."""
    return run_config(base, algorithm, n, work / f"{algorithm}_n{n}_s{base.seed}").digest()


def run_one(
    base: RunConfig,
    algorithm: str,
    n: int,
    warm: Path,
    work: Path,
    stored: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole job for (algorithm, N) from the warm start, and its figures (reused from
    `stored`, the study's JSON, or a finished run of the same config)."""
    from rlax_tpu.launch import job

    run_dir = work / f"{algorithm}_n{n}_s{base.seed}"
    config = run_config(base, algorithm, n, run_dir)
    digest = config.digest()
    if stored is not None and stored.get("config_digest") == digest:
        return {**stored, "reused": True}
    result_path = run_dir / "sweep_result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("config_digest") == digest:
            return {**result, "reused": True}
    start_from_warm_start(run_dir, warm)
    t0 = time.perf_counter()
    log = work / f"{algorithm}_n{n}_s{base.seed}.log"
    with open(log, "w") as out, contextlib.redirect_stdout(out):
        summary = job.run(config)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward_mean" in r]
    train_kl = [r["train/kl"] for r in trained[-LAST_STEPS:] if "train/kl" in r]
    # The drift between the policy trained and the one that generated its data: the mean
    # |log π_θ − log μ| per response token, over the run's steps.
    drift = [r[DRIFT] for r in trained if DRIFT in r]
    evals = {int(s): a for s, a in summary["evals"].items()}
    kl = kl_to_reference(run_dir, str(warm / "sft_model"))
    result = {
        "algorithm": algorithm,
        "max_staleness": n,
        "seed": base.seed,
        "config_digest": digest,
        "steps": summary["end_step"],
        "initial_accuracy": evals.get(0),
        "final_accuracy": evals[max(evals)],
        "kl_to_reference": kl["kl"],
        "kl_to_reference_stderr": kl["kl_stderr"],
        "kl_version": kl["version"],
        "response_length": kl["response_length"],
        "train_kl_k3": statistics.mean(train_kl) if train_kl else None,
        "reward_mean_last_10": statistics.mean(r["reward_mean"] for r in trained[-10:]),
        "drift": statistics.mean(drift) if drift else None,
        "staleness_mean": summary["staleness_mean"],
        "wall_s": round(wall, 1),
    }
    result_path.write_text(json.dumps(result, indent=2))
    return {**result, "reused": False}


# -- the report ----------------------------------------------------------------------------------
def _by_seed(results: list[dict], key: str) -> dict[tuple[str, int], list[float]]:
    """{(algorithm, N): [results[key] of each seed, in seed order]} (None values left out)."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in sorted(results, key=lambda r: r.get("seed", 0)):
        if r.get(key) is not None:
            out.setdefault((r["algorithm"], r["max_staleness"]), []).append(r[key])
    return out


def _spread(values: Sequence[float], fmt: str) -> str:
    """ "mean" of one value, "mean [min–max]" of several, "–" of none."""
    if not values:
        return "–"
    mean = fmt.format(statistics.mean(values))
    if len(values) == 1:
        return mean
    return f"{mean} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def paired_changes(results: list[dict], algorithm: str, ns: Sequence[int]) -> dict[int, float]:
    """{seed: final accuracy at N = max(ns) minus at N = min(ns)}, for the seeds with both
    (the two runs of a seed share its warm start and prompt order: a paired difference)."""
    by = {
        (r["max_staleness"], r.get("seed", 0)): r["final_accuracy"]
        for r in results
        if r["algorithm"] == algorithm
    }
    seeds = sorted({seed for (_, seed) in by})
    return {
        s: by[(ns[-1], s)] - by[(ns[0], s)] for s in seeds if (ns[0], s) in by and (ns[-1], s) in by
    }


def accuracy_changes(results: list[dict], algorithm: str, ns: Sequence[int]) -> list[float]:
    """Per seed, in seed order: final accuracy at N = max(ns) minus at N = min(ns)."""
    return list(paired_changes(results, algorithm, ns).values())


def bootstrap_interval(values: Sequence[float]) -> list[float] | None:
    """The 95 % percentile-bootstrap interval of the mean of `values` (seeds resampled with
    replacement, BOOTSTRAP_RESAMPLES times, from a fixed stream); None under two values."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = x[rng.integers(0, len(x), (BOOTSTRAP_RESAMPLES, len(x)))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return [float(low), float(high)]


def _summary(values: dict[int, float]) -> dict[str, Any]:
    interval = bootstrap_interval(list(values.values()))
    return {
        "per_seed": {str(k): v for k, v in values.items()},
        "seeds": len(values),
        "mean": statistics.mean(values.values()) if values else None,
        "ci95": interval,
        # Resolved: the interval excludes zero.
        "resolved": interval is not None and (interval[0] > 0 or interval[1] < 0),
    }


def analysis(results: list[dict], algorithms: Sequence[str], ns: Sequence[int]) -> dict:
    """What the study can tell: per objective the paired Δacc (N = max − N = min) per seed
    with its mean and bootstrap 95 % interval, the drift |log π_θ − log μ| at each N, and
    Δacc per unit of drift; per pair of objectives the difference of their Δacc on the
    seeds both have, with its interval."""
    out: dict[str, Any] = {"objectives": {}, "pairs": {}}
    changes = {a: paired_changes(results, a, ns) for a in algorithms}
    for a in algorithms:
        drift = {
            n: [
                r["drift"]
                for r in results
                if r["algorithm"] == a and r["max_staleness"] == n and r.get("drift") is not None
            ]
            for n in ns
        }
        mean_drift = {str(n): statistics.mean(v) if v else None for n, v in drift.items()}
        summary = _summary(changes[a])
        low, high = mean_drift[str(ns[0])], mean_drift[str(ns[-1])]
        if summary["mean"] is not None and low is not None and high is not None and high > low:
            summary["per_unit_drift"] = summary["mean"] / (high - low)
        out["objectives"][a] = {**summary, "drift": mean_drift}
    for i, a in enumerate(algorithms):
        for b in algorithms[i + 1 :]:
            both = sorted(set(changes[a]) & set(changes[b]))
            if len(both) >= 2:
                diff = {s: changes[a][s] - changes[b][s] for s in both}
                out["pairs"][f"{a} - {b}"] = _summary(diff)
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _interval(interval: list[float] | None) -> str:
    return "–" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"


def markdown_table(results: list[dict], algorithms: Sequence[str], ns: Sequence[int]) -> str:
    """Final held-out accuracy, drift and KL to the reference, one row per objective, by N:
    the mean over seeds and, with several, [min–max]; Δacc is the mean over seeds of each
    seed's change from N = min to N = max, with its bootstrap 95 % interval."""
    acc, kl = _by_seed(results, "final_accuracy"), _by_seed(results, "kl_to_reference")
    drift = _by_seed(results, "drift")
    header = (
        "| objective | seeds | "
        + " | ".join(f"acc N={n}" for n in ns)
        + " | Δacc | 95 % CI | "
        + " | ".join(f"drift N={n}" for n in ns)
        + " | "
        + " | ".join(f"KL N={n}" for n in ns)
        + " |"
    )
    lines = [header, "|" + "---|" * (3 * len(ns) + 4)]
    for a in algorithms:
        changes = accuracy_changes(results, a, ns)
        lines.append(
            f"| {LABELS[a]} | {len(changes)} | "
            + " | ".join(_spread(acc.get((a, n), []), "{:.3f}") for n in ns)
            + f" | {_spread(changes, '{:+.3f}')} | {_interval(bootstrap_interval(changes))} | "
            + " | ".join(_spread(drift.get((a, n), []), "{:.3f}") for n in ns)
            + " | "
            + " | ".join(_spread(kl.get((a, n), []), "{:.3f}") for n in ns)
            + " |"
        )
    return "\n".join(lines)


def reading(results: list[dict], algorithms: Sequence[str], ns: Sequence[int]) -> str:
    """What the intervals support: each objective's Δacc, and each pair's difference, said
    only where its bootstrap 95 % interval excludes zero ("not resolved" otherwise)."""
    found = analysis(results, algorithms, ns)
    lines = [f"final accuracy at N={ns[-1]} minus at N={ns[0]}, paired by seed, mean [95 % CI]:"]
    for a, o in found["objectives"].items():
        if o["mean"] is None:
            continue
        if o["resolved"]:
            verdict = "loses accuracy" if o["mean"] < 0 else "gains accuracy"
        else:
            verdict = "not resolved"
        lines.append(
            f"  {LABELS[a]}: {o['mean']:+.3f} {_interval(o['ci95'])} over {o['seeds']} seeds: "
            f"{verdict}"
        )
    pairs = [(k, v) for k, v in found["pairs"].items() if v["seeds"] >= 2]
    if pairs:
        lines.append("differences of Δacc between objectives (a − b), paired by seed:")
        for key, v in pairs:
            a, b = key.split(" - ")
            if v["resolved"]:
                more = LABELS[b] if v["mean"] > 0 else LABELS[a]
                verdict = f"{more} loses more to staleness"
            else:
                verdict = "not resolved"
            lines.append(
                f"  {LABELS[a]} − {LABELS[b]}: {v['mean']:+.3f} {_interval(v['ci95'])} over "
                f"{v['seeds']} seeds: {verdict}"
            )
    return "\n".join(lines)


def plot(
    results: list[dict], algorithms: Sequence[str], ns: Sequence[int], size: int, path: Path
) -> None:
    """Final accuracy and KL against N, one line per objective: the mean over seeds with the
    min–max band of the seeds (one seed: ± the binomial standard error on `size` prompts,
    and the KL's standard error over prompts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc, kl = _by_seed(results, "final_accuracy"), _by_seed(results, "kl_to_reference")
    kl_err = _by_seed(results, "kl_to_reference_stderr")

    def band(values: list[float], one_seed_error: float) -> tuple[float, list[float]]:
        mean = statistics.mean(values)
        if len(values) == 1:
            return mean, [one_seed_error, one_seed_error]
        return mean, [mean - min(values), max(values) - mean]

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = list(range(len(ns)))
    # Distinct markers and dashes: objectives with equal results would hide each other.
    styles = {
        "grpo": ("o", "-"),
        "dr_grpo": ("s", "--"),
        "aipo": ("D", ":"),
        "trajectory_balance": ("^", "-."),
        "online_dpo": ("v", "-"),
        "grpo_dual_clip": ("P", "--"),
        "grpo_tis": ("X", ":"),
        "tb_tba": ("<", "--"),
        "online_dpo_graded": (">", ":"),
    }
    for a in algorithms:
        marker, dashes = styles.get(a, ("*", "-"))
        accuracy = [
            band(acc[(a, n)], math.sqrt(m * (1 - m) / size))
            for n in ns
            for m in [statistics.mean(acc[(a, n)])]
        ]
        kls = [band(kl[(a, n)], statistics.mean(kl_err[(a, n)])) for n in ns]
        for ax, points in ((left, accuracy), (right, kls)):
            ax.errorbar(
                x,
                [mean for mean, _ in points],
                yerr=list(zip(*(err for _, err in points), strict=True)),
                marker=marker,
                linestyle=dashes,
                capsize=3,
                label=LABELS[a],
            )
    initial = next(r["initial_accuracy"] for r in results if r["initial_accuracy"] is not None)
    left.axhline(initial, color="grey", linestyle="--", linewidth=1, label="SFT start")
    left.set_ylabel("final held-out greedy accuracy")
    right.set_ylabel("KL(π_θ ‖ π_SFT) per response (nats)")
    for ax in (left, right):
        ax.set_xticks(x, [str(n) for n in ns])
        ax.set_xlabel("max staleness N (η = 1)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    steps = results[0]["steps"]
    seeds = len({r.get("seed", 0) for r in results})
    fig.suptitle(
        f"Staleness robustness on the demo task ({steps} RL steps, {seeds} seed(s): mean and "
        "min–max)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_seeds(text: str) -> tuple[int, ...]:
    """ "0,1,2" or "0-9" or "0-4,7": the seeds, in order, each once."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        for seed in range(int(first), int(last or first) + 1):
            if seed not in seeds:
                seeds.append(seed)
    return tuple(seeds)


def load_store(path: Path | None) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The runs already in the study's JSON, by (objective, N, seed)."""
    if path is None or not path.exists():
        return {}
    runs = json.loads(path.read_text()).get("runs", [])
    return {(r["algorithm"], r["max_staleness"], r["seed"]): r for r in runs}


def report(
    store: dict[tuple[str, int, int], dict[str, Any]],
    base: RunConfig,
    overrides: Sequence[str],
    quick: bool,
) -> dict[str, Any]:
    """The study as it stands: every run kept, and what their seeds can tell."""
    runs = [
        {k: v for k, v in r.items() if k != "reused"}
        for _, r in sorted(store.items(), key=lambda kv: (ALGORITHMS.index(kv[0][0]), *kv[0][1:]))
    ]
    algorithms = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in runs)]
    ns = sorted({r["max_staleness"] for r in runs})
    return {
        "quick": quick,
        "seeds": sorted({r["seed"] for r in runs}),
        "algorithms": algorithms,
        "max_staleness": ns,
        "steps": base.controller.num_steps,
        "eval_size": base.controller.eval_size,
        "behaviour_logprobs": base.trainer.behaviour_logprobs,
        "overrides": list(overrides),
        "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "level": 0.95},
        "analysis": analysis(runs, algorithms, ns) if len(ns) > 1 else {},
        "table_markdown": markdown_table(runs, algorithms, ns) if len(ns) > 1 else "",
        "reading": reading(runs, algorithms, ns) if len(ns) > 1 else "",
        "runs": runs,
    }


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # a reader (or a crash) never sees half a study


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 objectives x 2 N, a few steps")
    parser.add_argument(
        "--json",
        type=Path,
        help="the study's record: read first (its runs are kept and not run again), "
        "rewritten after every run",
    )
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--steps", type=int, help="RL steps per run (default: SWEEP's)")
    parser.add_argument("--work-dir", type=Path, help="default runs/staleness_sweep[_quick]")
    parser.add_argument("--algorithms", help=f"comma-separated, from {','.join(ALGORITHMS)}")
    parser.add_argument("--staleness", help="comma-separated values of N (default 0,16)")
    parser.add_argument("--seeds", help="seeds: 0,1,2 or 0-9 (default 0-9; quick 0)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override key=value"
    )
    args = parser.parse_args(argv)
    algorithms = (
        tuple(args.algorithms.split(","))
        if args.algorithms
        else (QUICK_ALGORITHMS if args.quick else COMPARED)
    )
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown objectives {unknown}; choose from {', '.join(ALGORITHMS)}")
    ns = (
        tuple(sorted(int(n) for n in args.staleness.split(",")))
        if args.staleness
        else (QUICK_STALENESS if args.quick else STALENESS)
    )
    seeds = parse_seeds(args.seeds) if args.seeds else (QUICK_SEEDS if args.quick else SEEDS)
    base = sweep_config(args.quick, args.steps, args.overrides)
    overrides = [
        *(QUICK if args.quick else SWEEP),
        *args.overrides,
        *([f"controller.num_steps={args.steps}"] if args.steps is not None else []),
    ]
    configure_jax(base)  # before JAX starts: the SFT trainer's mesh needs cpu_devices
    work = args.work_dir or ROOT / "runs" / (
        "staleness_sweep_quick" if args.quick else "staleness_sweep"
    )
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    store = load_store(args.json)
    t0 = time.perf_counter()
    for seed in seeds:
        seeded = dataclasses.replace(base, seed=seed)
        cells = [(a, n) for a in algorithms for n in ns]
        todo = [
            (a, n)
            for a, n in cells
            if store.get((a, n, seed), {}).get("config_digest") != cell_digest(seeded, a, n, work)
        ]
        if not todo:
            continue
        steps = base.trainer.warm_start.steps
        print(f"work dir {work}; seed {seed}: SFT warm start ({steps} steps)")
        warm = warm_start(seeded, work)
        print(f"warm start ready in {time.perf_counter() - t0:.0f}s: {warm}", flush=True)
        for algorithm, n in todo:
            result = run_one(seeded, algorithm, n, warm, work, store.get((algorithm, n, seed)))
            store[(algorithm, n, seed)] = result
            if args.json:
                _write(args.json, report(store, base, overrides, args.quick))
            print(
                f"{LABELS[algorithm]:<16} N={n:<3} seed {seed} final acc "
                f"{result['final_accuracy']:.3f} (start {result['initial_accuracy']:.3f})  "
                f"drift {_cell(result.get('drift'), '{:.3f}')}  KL "
                f"{result['kl_to_reference']:.3f} ± {result['kl_to_reference_stderr']:.3f}  "
                + ("(reused)" if result["reused"] else f"{result['wall_s']:.0f}s"),
                flush=True,
            )
    study = report(store, base, overrides, args.quick)
    if args.json:
        _write(args.json, study)
    print()
    print(
        f"demo task, {base.controller.num_steps} RL steps of {base.controller.prompts_per_batch}"
        f"x{base.controller.samples_per_prompt}, η=1, seeds {study['seeds']}, importance "
        f"weights against the {base.trainer.behaviour_logprobs} behaviour log-probs (GRPO + "
        "TIS: recomputed π_old, TIS against the workers'); final held-out greedy accuracy on "
        f"{base.controller.eval_size} problems, drift |log π_θ − log μ| per token, and "
        "KL(π_θ‖π_SFT) in nats per response"
    )
    print(study["table_markdown"])
    print()
    print(study["reading"])
    print(f"total {time.perf_counter() - t0:.0f}s")
    if args.plot and len(study["max_staleness"]) > 1:
        plot(
            study["runs"],
            study["algorithms"],
            study["max_staleness"],
            base.controller.eval_size,
            args.plot,
        )
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
