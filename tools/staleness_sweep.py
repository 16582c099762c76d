#!/usr/bin/env python3
"""How robust is each RL objective to stale rollouts? The demo task at N ∈ {0, 4, 16}.

    python tools/staleness_sweep.py [--quick] [--json OUT] [--plot OUT.png] [--steps N]
        [--work-dir DIR] [--algorithms a,b] [--staleness 0,4] [--seeds 0,1,2]
        [--set key=value ...]

The demo (configs/tiny_cpu.py, arithmetic with a character-level model) is warm-started by
SFT once; then, from those weights, with the same seed and prompt order, the whole job
(`rlax_tpu.controller.job.run`: launcher, parameter server, trainer, inference worker,
verifiers, controller) runs a short RL phase for each algorithm preset (GRPO, Dr. GRPO,
AIPO, trajectory balance, online DPO; as published, see docs/algorithms.md), two GRPO
variants (dual clip, c = 3; TIS: the truncated importance weight min(π_old/π_rollout, 2) on
top of GRPO, with π_old recomputed by the trainer) and each acceptance staleness N (η = 1,
deterministic schedule: batch b is generated with version max(0, b − N)), once per seed
(each seed its own warm start, prompt order and sampling). Importance weights are taken
against the workers' behaviour log-probs (`trainer.behaviour_logprobs=cached`, see SWEEP;
the TIS variant is the exception: its ratio is to the recomputed π_old, and its TIS weight
corrects π_old against the workers' π_rollout). For each run it records

* final held-out greedy accuracy (the controller's evaluation at the last step) and the SFT
  model's (step 0, the same for every run);
* KL(π_θ ‖ π_ref) of the final policy to the SFT reference, measured the same way for every
  objective (most do not compute a KL while training): on the held-out prompts, responses
  are sampled from the final policy (temperature 1, up to `inference.max_new_tokens`
  tokens); along each response the exact KL between the two next-token distributions (all
  of the vocabulary) is summed over its tokens, then averaged over samples and prompts. This
  is an unbiased estimate of the sequence-level KL, in nats per response;
* the trainer's own `kl` metric (k3 per token on the rollouts it trained on, averaged over
  the last steps) where the objective reports one.

It writes a markdown table of the mean over seeds with the min–max range (stdout, and into
--json with every run's figures) and a PNG of final accuracy and KL against N (--plot;
needs matplotlib: `pip install -e .[plots]`). Runs are kept under --work-dir and reused
when their config is unchanged, so an interrupted sweep continues. `--quick` is a smoke
test: 2 objectives x 2 values of N, one seed, a short warm start and a few steps.
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

from rlax_tpu.config import AlgorithmConfig, RunConfig, StalenessConfig, load_config  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402

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
)
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
}
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
    "tb_reset": ("trajectory_balance", {"reference_reset_every": TBA_RESET_EVERY}, {}, {}),
    # ... and TBA-PRIME (TBA Eq. 16): Σ_t sg(min(λ_t, 8)·(r − r̄ − β(log Λ − mean log Λ)))
    # ·∇log π_θ(y_t), λ_t = π_θ/μ per token, log Λ = Σ_t log π/π_ref, β = 0.005, the reference
    # reset every ρ steps. In parts: AIPO's truncated token weight at 8 (sequence sum, keep
    # all) on the group-mean advantage of a reward with the k1 KL folded in (which reads
    # π_old, here the behaviour policy, where TBA reads π_θ).
    "tba_prime": (
        "aipo",
        {
            "rho_max": 8.0,
            "kl_in_reward": True,
            "kl_estimator": "k1",
            "kl_beta": 0.005,
            "kl_beta_final": 0.005,
            "reference_reset_every": TBA_RESET_EVERY,
        },
        {},
        {},
    ),
    # Noukhovitch et al.'s online DPO draws 2 samples per prompt (TL;DR), or takes the best
    # and worst of 4 (GSM8K); the preset's β = 0.1 is theirs. The global batch stays 64.
    "online_dpo_k4": ("online_dpo", {}, {}, {"prompts_per_batch": 16, "samples_per_prompt": 4}),
    "online_dpo_k2": ("online_dpo", {}, {}, {"prompts_per_batch": 32, "samples_per_prompt": 2}),
}
STALENESS = (0, 4, 16)
SEEDS = (0, 1, 2)
QUICK_ALGORITHMS = ("grpo", "online_dpo")
QUICK_STALENESS = (0, 4)
QUICK_SEEDS = (0,)
# The seed papers' reading (docs/algorithms.md, "Which presets tolerate stale data").
MOST_ROBUST = ("trajectory_balance", "online_dpo")
PPO_STYLE = ("grpo", "dr_grpo")
# The warm start's trainer checkpoint: a run directory holding it starts RL from its version 0
# (the trainer does not redo the warm start); its HF export sft_model/ is for the peers.
WARM_START_FILES = ("tokenizer", "data", "checkpoints_warm_start")
# Steps whose trainer `kl` metric is averaged.
LAST_STEPS = 5
KL_SAMPLES = 4  # responses per held-out prompt for the KL estimate
KL_SEED = 20250101

# The demo's task and objective settings on a smaller model (as tools/bench_e2e.py --quick),
# so that 20 runs fit in an hour on two CPU cores; no evaluation between start and end.
# The importance weight is taken against the behaviour policy μ that generated the rollouts
# (the workers' log-probs), as in the seed papers' staleness experiments. With the trainer's
# default, π_old recomputed at the version being trained, a batch trained in one mini-batch
# has ratio 1 whatever its staleness: no clip, truncation or IS weight ever acts.
SWEEP = [
    "trainer.behaviour_logprobs=cached",
    # The demo's learning rate until 2026-11-28 (5e-5 since, docs/learning.md): every sweep
    # in docs/data.md ran with it.
    "trainer.learning_rate=1e-4",
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.head_dim=16",
    "controller.sft_steps=600",
    "controller.num_steps=40",
    "controller.eval_every=0",
    "controller.eval_size=512",
]
QUICK = [*SWEEP, "controller.sft_steps=200", "controller.num_steps=8", "controller.eval_size=128"]


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
    """What the warm start depends on: model, SFT settings, data, seed, trainer shape."""
    c = config.controller
    trainer = config.trainer.to_dict()
    for field in ("learning_rate", "algorithm", "behaviour_logprobs"):  # RL only
        trainer.pop(field)
    parts = {
        "seed": config.seed,
        "model": config.model.to_dict(),
        "trainer": trainer,
        "datasets": [d.to_dict() for d in c.datasets],
        "eval_dataset": c.eval_dataset,
        "sft": [c.sft_steps, c.sft_learning_rate, c.global_batch_size],  # its batch: all rows
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(config: RunConfig, work: Path) -> Path:
    """SFT once into work/warm_start-<key> (reused when it is there); returns that directory."""
    from rlax_tpu.controller import job
    from rlax_tpu.models.tokenizer import Tokenizer

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
    from rlax_tpu.param_server.store import VersionStore
    from rlax_tpu.tree import flatten, unflatten_like

    store = VersionStore(str(run_dir / "params"), hot_versions=1)
    version = max(v.version for v in store.versions())
    return version, unflatten_like(like, {p: store.read(version, p) for p in flatten(like)})


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
    from rlax_tpu.controller import job
    from rlax_tpu.controller.datasets import load_dataset
    from rlax_tpu.models.hf import build_model, load_hf_config, load_hf_params
    from rlax_tpu.models.tokenizer import Tokenizer

    effective = RunConfig.from_dict(json.loads((run_dir / job.EFFECTIVE_CONFIG).read_text()))
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
def run_one(base: RunConfig, algorithm: str, n: int, warm: Path, work: Path) -> dict[str, Any]:
    """The whole job for (algorithm, N) from the warm start, and its figures (reused from a
    finished run of the same config)."""
    from rlax_tpu.controller import job

    run_dir = work / f"{algorithm}_n{n}_s{base.seed}"
    config = run_config(base, algorithm, n, run_dir)
    digest = config.digest()
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
        "staleness_mean": summary["staleness_mean"],
        "wall_s": round(wall, 1),
    }
    result_path.write_text(json.dumps(result, indent=2))
    return {**result, "reused": False}


# -- the report ----------------------------------------------------------------------------------
def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


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


def accuracy_changes(results: list[dict], algorithm: str, ns: Sequence[int]) -> list[float]:
    """Per seed: final accuracy at N = max(ns) minus at N = min(ns) (seeds with both)."""
    by = {
        (r["max_staleness"], r.get("seed", 0)): r["final_accuracy"]
        for r in results
        if r["algorithm"] == algorithm
    }
    seeds = sorted({seed for (_, seed) in by})
    return [
        by[(ns[-1], s)] - by[(ns[0], s)] for s in seeds if (ns[0], s) in by and (ns[-1], s) in by
    ]


def markdown_table(results: list[dict], algorithms: Sequence[str], ns: Sequence[int]) -> str:
    """Final held-out accuracy and KL to the reference, one row per objective, by N: the mean
    over seeds and, with several, [min–max]; Δacc is the mean over seeds of each seed's
    change from N = min to N = max."""
    acc, kl = _by_seed(results, "final_accuracy"), _by_seed(results, "kl_to_reference")
    header = (
        "| objective | "
        + " | ".join(f"acc N={n}" for n in ns)
        + " | Δacc | "
        + " | ".join(f"KL N={n}" for n in ns)
        + " |"
    )
    lines = [header, "|" + "---|" * (2 * len(ns) + 2)]
    for a in algorithms:
        lines.append(
            f"| {LABELS[a]} | "
            + " | ".join(_spread(acc.get((a, n), []), "{:.3f}") for n in ns)
            + f" | {_spread(accuracy_changes(results, a, ns), '{:+.3f}')} | "
            + " | ".join(_spread(kl.get((a, n), []), "{:.3f}") for n in ns)
            + " |"
        )
    return "\n".join(lines)


def reading(results: list[dict], algorithms: Sequence[str], ns: Sequence[int], size: int) -> str:
    """Which objectives kept their accuracy best from N = min to N = max, against the papers."""
    changes = {a: accuracy_changes(results, a, ns) for a in algorithms}
    change = {a: statistics.mean(c) for a, c in changes.items()}
    seeds = min(len(c) for c in changes.values())
    order = sorted(algorithms, key=lambda a: -change[a])  # most robust first
    # Binomial standard error of one accuracy at p ≈ the mean final accuracy, √2 for a
    # difference, / √seeds for a mean over seeds: the evaluation's noise alone.
    p = statistics.mean(r["final_accuracy"] for r in results)
    noise = math.sqrt(2 * p * (1 - p) / size / seeds)
    lines = [
        f"final accuracy at N={ns[-1]} minus at N={ns[0]}, mean over {seeds} seed(s) (most "
        "robust first): "
        + ", ".join(f"{LABELS[a]} {_spread(changes[a], '{:+.3f}')}" for a in order),
        f"a mean over {seeds} seed(s) of differences of two accuracies on {size} prompts has a "
        f"standard error of about {noise:.3f} from the evaluation alone, so gaps under "
        f"~{2 * noise:.2f} are not resolved (the RL runs' own sampling noise comes on top: "
        "the [min–max] over seeds shows it).",
    ]
    robust = [a for a in MOST_ROBUST if a in algorithms]
    ppo = [a for a in PPO_STYLE if a in algorithms]
    if robust and ppo:
        ranked = [a for a in order if a in robust + ppo]
        best, worst = ranked[: len(robust)], ranked[-len(ppo) :]
        agree = set(best) == set(robust) and set(worst) == set(ppo)
        spread = max(change[a] for a in ranked) - min(change[a] for a in ranked)
        lines.append(
            "seed papers: online DPO and trajectory balance the most robust to stale data, "
            f"PPO-style losses (GRPO, Dr. GRPO) the least. The order of these runs "
            f"{'agrees' if agree else 'does not agree'} (most robust "
            f"{', '.join(LABELS[a] for a in best)}; least {', '.join(LABELS[a] for a in worst)})"
            + (
                f", but the spread of the changes ({spread:.3f}) is within the noise."
                if spread < 2 * noise
                else "."
            )
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
    }
    for a in algorithms:
        marker, dashes = styles[a]
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 objectives x 2 N, a few steps")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--steps", type=int, help="RL steps per run (default 40; quick 8)")
    parser.add_argument("--work-dir", type=Path, help="default runs/staleness_sweep[_quick]")
    parser.add_argument("--algorithms", help=f"comma-separated, from {','.join(ALGORITHMS)}")
    parser.add_argument("--staleness", help="comma-separated values of N")
    parser.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; quick 0)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override key=value"
    )
    args = parser.parse_args(argv)
    algorithms = (
        tuple(args.algorithms.split(","))
        if args.algorithms
        else (QUICK_ALGORITHMS if args.quick else ALGORITHMS)
    )
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown objectives {unknown}; choose from {', '.join(ALGORITHMS)}")
    ns = (
        tuple(sorted(int(n) for n in args.staleness.split(",")))
        if args.staleness
        else (QUICK_STALENESS if args.quick else STALENESS)
    )
    seeds = (
        tuple(int(s) for s in args.seeds.split(","))
        if args.seeds
        else (QUICK_SEEDS if args.quick else SEEDS)
    )
    base = sweep_config(args.quick, args.steps, args.overrides)
    configure_jax(base)  # before JAX starts: the SFT trainer's mesh needs cpu_devices
    work = args.work_dir or ROOT / "runs" / (
        "staleness_sweep_quick" if args.quick else "staleness_sweep"
    )
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for seed in seeds:
        seeded = dataclasses.replace(base, seed=seed)
        print(f"work dir {work}; seed {seed}: SFT warm start ({base.controller.sft_steps} steps)")
        warm = warm_start(seeded, work)
        print(f"warm start ready in {time.perf_counter() - t0:.0f}s: {warm}", flush=True)
        for algorithm in algorithms:
            for n in ns:
                result = run_one(seeded, algorithm, n, warm, work)
                results.append(result)
                print(
                    f"{LABELS[algorithm]:<16} N={n:<3} seed {seed} final acc "
                    f"{result['final_accuracy']:.3f} "
                    f"(start {result['initial_accuracy']:.3f})  KL "
                    f"{result['kl_to_reference']:.3f} ± {result['kl_to_reference_stderr']:.3f}  "
                    + ("(reused)" if result["reused"] else f"{result['wall_s']:.0f}s"),
                    flush=True,
                )
    table = markdown_table(results, algorithms, ns)
    text = reading(results, algorithms, ns, base.controller.eval_size)
    print()
    print(
        f"demo task, {base.controller.num_steps} RL steps of {base.controller.prompts_per_batch}"
        f"x{base.controller.samples_per_prompt}, η=1, seeds {list(seeds)} (mean [min–max]), "
        f"importance weights against the {base.trainer.behaviour_logprobs} behaviour log-probs "
        "(GRPO + TIS: recomputed π_old, TIS against the workers'); final held-out greedy "
        f"accuracy on {base.controller.eval_size} prompts and KL(π_θ‖π_SFT) in nats per response"
    )
    print(table)
    print()
    print(text)
    print(f"total {time.perf_counter() - t0:.0f}s")
    report = {
        "quick": args.quick,
        "algorithms": list(algorithms),
        "max_staleness": list(ns),
        "steps": base.controller.num_steps,
        "eval_size": base.controller.eval_size,
        "seeds": list(seeds),
        "behaviour_logprobs": base.trainer.behaviour_logprobs,
        "overrides": [
            *(QUICK if args.quick else SWEEP),
            *args.overrides,
            *([f"controller.num_steps={args.steps}"] if args.steps is not None else []),
        ],
        "runs": results,
        "table_markdown": table,
        "reading": text,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(results, algorithms, ns, base.controller.eval_size, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
