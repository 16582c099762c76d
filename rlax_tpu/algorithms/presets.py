"""The named presets: each a configuration of the parts, with its paper's defaults.

Every function returns the resolved `AlgorithmConfig` of its preset; its docstring holds
the formula it implements and the source. The values live in the JAX-free
`AlgorithmConfig._PRESET_VALUES`, so `--set trainer.algorithm=NAME` works without JAX.
Notation: group g of prompt x with K samples y_i, reward r_i, r_t = π_θ(y_t)/μ(y_t) the
token ratio to the behaviour policy μ, sg the stop-gradient, B the number of sequences.
"""

from __future__ import annotations

from collections.abc import Callable

from rlax_tpu.config import AlgorithmConfig


def reinforce() -> AlgorithmConfig:
    """REINFORCE (Williams 1992; RLAX App. A).

    J = 1/B Σ_i r_i · Σ_t log π_θ(y_{i,t}).  w = 1/B, ρ = 1, A = r, M = 1, no KL.
    """
    return AlgorithmConfig.preset("reinforce")


def rloo() -> AlgorithmConfig:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024).

    J = 1/B Σ_i (r_i − 1/(K−1) Σ_{j≠i} r_j) · Σ_t log π_θ(y_{i,t}).  w = 1/B, ρ = 1, M = 1.
    """
    return AlgorithmConfig.preset("rloo")


def proximal_rloo() -> AlgorithmConfig:
    """Proximal RLOO (Noukhovitch et al. 2024, App. B; TBA Eq. 6 with π_old, not π_ref).

    J = 1/B Σ_i min(ρ_i Â_i, clip(ρ_i, 1−ε, 1+ε) Â_i), ρ_i = π_θ(y_i)/π_old(y_i) (whole-
    sequence product), Â = leave-one-out, ε = 0.2 (TRL's cliprange).
    ∇J = 1/B Σ_i sg(ρ_i) Â_i M_i ∇log π_θ(y_i): w = 1/B, ρ = sequence (product),
    M = sequence clip mask.
    """
    return AlgorithmConfig.preset("proximal_rloo")


def grpo() -> AlgorithmConfig:
    """GRPO (Shao et al. 2024, DeepSeekMath Eq. 3; RLAX Eq. 8).

    J = 1/B Σ_i 1/|y_i| Σ_t [min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i) − β D_KL^{k3}],
    Â_i = (r_i − mean_g r)/std_g r, D^{k3} = π_ref/π_θ − log(π_ref/π_θ) − 1; ε = 0.2, β = 0.04.
    Parts: w = 1/(B|y_i|), ρ = sg(r_t), A = group mean/std, M = PPO clip mask, R = β·k3.
    """
    return AlgorithmConfig.preset("grpo")


def dapo() -> AlgorithmConfig:
    """DAPO (Yu et al. 2025, Eq. 8).

    J = E_x[1/Σ_{i∈g}|y_i| Σ_i Σ_t min(r_t Â_i, clip(r_t, 1−ε_low, 1+ε_high) Â_i)],
    ε_low = 0.2, ε_high = 0.28 (clip-higher), no KL; Â as GRPO. Parts: w = token mean per
    group, then mean over groups. Dynamic sampling (keep groups with 0 < #correct < K) is
    the controller's `controller.filters.dynamic_sampling_keep`; overlong shaping is a reward
    matter.
    verl implements the token mean over the whole batch: aggregation="token_mean".
    """
    return AlgorithmConfig.preset("dapo")


def dr_grpo() -> AlgorithmConfig:
    """Dr. GRPO (Liu et al. 2025, 'Understanding R1-Zero-like training').

    J = 1/B Σ_i Σ_t min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i) / L, Â_i = r_i − mean_g r, ε = 0.2,
    no KL: GRPO without the length (1/|y_i|) and std biases. w = 1/(B·L) with L the
    generation budget (set max_response_len to it; 0 = the padded length).
    """
    return AlgorithmConfig.preset("dr_grpo")


def gspo() -> AlgorithmConfig:
    """GSPO (Zheng et al. 2025, Eq. 5).

    J = 1/B Σ_i min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i),
    s_i = (π_θ(y_i)/μ(y_i))^{1/|y_i|} = exp(1/|y_i| Σ_t log r_t), ε = 3e-4 / 4e-4, Â as GRPO.
    ∇J = 1/B Σ_i sg(s_i) Â_i M_i 1/|y_i| Σ_t ∇log π_θ(y_t): w = 1/(B|y_i|), ρ = sequence
    (geometric mean), M = sequence clip mask, no KL.
    """
    return AlgorithmConfig.preset("gspo")


def cispo() -> AlgorithmConfig:
    """CISPO (Chen et al. 2025, MiniMax-M1 Eq. 4; RLAX Eq. 10).

    J = E_x[1/Σ_{i∈g}|y_i| Σ_i Σ_t sg(r̂_t) Â_i log π_θ(y_t)], r̂_t = clip(r_t, 1−ε_low^IS,
    1+ε_high^IS), Â as GRPO, no KL. The clipped weight is a weight, not a mask: every token
    keeps its gradient. No lower bound (ρ_min = 0, as MiniMax); ρ_max = 8 as in TBA's
    CISPO runs (MiniMax tuned ε_high^IS but did not report it).
    """
    return AlgorithmConfig.preset("cispo")


def reinforce_pp() -> AlgorithmConfig:
    """REINFORCE++-baseline (Hu et al. 2025; RLAX §4.2: Eqs. 11–12 and the k2 estimator).

    Ã_i = r_i − mean_g r, Â_i = Ã_i / std_B(Ã) (group baseline, global batch std);
    J = 1/B Σ_i 1/|y_i| Σ_t [min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i) − β·½(log π_θ/π_ref)²],
    ε = 0.2, β = 1e-3 (OpenRLHF/ROLL examples; the paper fixes no value for this variant).
    The paper's group-sampling variant for reasoning; REINFORCE++ proper (no group
    baseline) is `reinforce_pp_batch`.
    """
    return AlgorithmConfig.preset("reinforce_pp")


def reinforce_pp_batch() -> AlgorithmConfig:
    """REINFORCE++ (Hu et al. 2025, the k ≥ 1 variant), as far as the parts express it.

    Â_i = (r_i − mean_B r)/std_B r (global batch normalisation, no group baseline);
    J = 1/B Σ_i 1/|y_i| Σ_t [min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i) − β·½(log π_θ/π_ref)²],
    ε = 0.2, β = 0.01 (the paper's general-RLHF setting; 0.001 with rule-based rewards).
    Approximation: the paper folds a k1 KL into the reward before normalising,
    A_t = r − β Σ_{s≥t} log(π_old/π_ref)(y_s). The parts take the reward as given, so the
    KL is the k2 loss term R instead, whose gradient β·(log π_θ − log π_ref)·∇log π_θ is
    the same-token part of the in-reward KL's gradient (a k1 loss would have none in
    expectation). Parts: w = 1/(B|y_i|), ρ = sg(r_t), A = batch_norm, M = PPO clip mask,
    R = β·k2. The paper's exact form, KL in the reward, is `reinforce_pp_return_to_go`.
    """
    return AlgorithmConfig.preset("reinforce_pp_batch")


def reinforce_pp_return_to_go() -> AlgorithmConfig:
    """REINFORCE++ as published (Hu et al. 2025), verl's reinforce_plus_plus estimator.

    R_t = r·1[t = |y|] − β·log(π_old(y_t)/π_ref(y_t)) (k1 KL folded into the reward,
    β = 0.01), G_t = Σ_{s≥t} γ^{s−t} R_s (γ = 1), Â_t = (G_t − mean G)·(var G + 1e-8)^−½
    over every response token of the batch (var with n − 1: verl's masked_whiten);
    J = 1/B Σ_i 1/|y_i| Σ_t min(r_t Â_t, clip(r_t, 1−ε, 1+ε) Â_t), ε = 0.2, no KL loss.
    Parts: w = 1/(B|y_i|), ρ = sg(r_t), A = reinforce_pp_return_to_go (whitened by the
    estimator itself, so advantage_options.whiten stays off), M = PPO clip mask, R in the reward.
    verl's example run keeps the reward unshaped and adds a k2 loss instead:
    kl.in_reward=False, kl_estimator="k2", kl.beta=1e-3.
    """
    return AlgorithmConfig.preset("reinforce_pp_return_to_go")


def ppo() -> AlgorithmConfig:
    """PPO with GAE and a value head (Schulman et al. 2017, 2015; Huang et al. 2024).

    J = 1/N Σ_{i,t} min(r_t Â_t, clip(r_t, 1−ε, 1+ε) Â_t) − c_V·½ max((V−R)², (V_clip−R)²),
    Â = GAE(γ = 1, λ = 0.95) over V_old with the reward at the last token, R = Â + V_old,
    V_clip = V_old + clip(V − V_old, ±0.2), ε = 0.2, c_V = 0.1; mean over all response
    tokens. The policy sees Â whitened over the batch's response tokens,
    (Â − mean)·(var + 1e-8)^−½ with var over n − 1, as verl's compute_gae_advantage_return
    and Tunix's compute_gae_advantages do (advantage_options.whiten=True; R uses Â before it).
    Every other preset leaves advantage_options.whiten off: their papers' advantages are not
    whitened per token, or the estimator whitens itself (reinforce_pp_return_to_go).
    Huang et al. add a k1 KL (0.05) to the reward: kl.beta=0.05, kl_estimator="k1",
    kl.in_reward=True (verl's use_kl_in_reward, Tunix's default); none here.
    """
    return AlgorithmConfig.preset("ppo")


def aipo() -> AlgorithmConfig:
    """AIPO (Wu et al. 2025, LlamaRL §6).

    g = Σ_t min(π_θ(y_t)/μ(y_t), ρ) Â ∇log π_θ(y_t), Â_i = r_i − mean_g r (the group mean
    including i, no std), no clip mask, ρ ∈ [2, 10] (here 2). Surrogate:
    J = 1/B Σ_i Σ_t sg(min(r_t, ρ)) Â_i log π_θ(y_t): w = 1/B, ρ = token truncated, M = 1.
    """
    return AlgorithmConfig.preset("aipo")


def remax() -> AlgorithmConfig:
    """ReMax (Li et al. 2023), in verl's recipe (examples/remax_trainer).

    Â_t = Σ_{s≥t} R_s − r(x, ȳ), ȳ the prompt's greedy response (batch.baseline_rewards),
    R_t = r·1[t = |y|] − β·log(π_old(y_t)/π_ref(y_t)) (k1 KL in the reward, β = 1e-3), no
    std normalisation; J = 1/N Σ_{i,t} min(r_t Â_t, clip(r_t, 1−ε, 1+ε) Â_t), ε = 0.2,
    N = the batch's response tokens (verl's token mean). The paper's on-policy REINFORCE,
    g = 1/B Σ_i (r(y_i) − r(ȳ_i)) Σ_t ∇log π_θ(y_{i,t}), is this with one step per batch
    (r_t = 1, the clip idle), β = 0 and aggregation="sequence_sum" (w = 1/B). The rollout
    side must score each prompt's greedy response and pass it as baseline_rewards.
    """
    return AlgorithmConfig.preset("remax")


def opo() -> AlgorithmConfig:
    """OPO (Hao et al. 2025, 'On-Policy RL with Optimal Reward Baseline'), as in verl.

    Â_i = r_i − b_g, b_g = Σ_{j∈g}|y_j| r_j / Σ_{j∈g}|y_j| (the length-weighted group mean:
    the baseline of least gradient variance), no std normalisation;
    J = 1/N Σ_{i,t} min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i), ε = 0.2, token mean, no KL, no
    entropy bonus. Exact on-policy training (one optimizer step per batch: verl's
    ppo_mini_batch_size = train_batch_size) is the trainer's schedule; then r_t = 1, the
    clip never binds and ∇J = 1/N Σ_{i,t} Â_i ∇log π_θ(y_{i,t}).
    """
    return AlgorithmConfig.preset("opo")


def gpg() -> AlgorithmConfig:
    """GPG (Chu et al. 2025, 'GPG: A Simple and Strong RL Baseline for Model Reasoning').

    J = 1/N Σ_{i,t} Â_i log π_θ(y_{i,t}): plain policy gradient, no ratio, no clip, no KL,
    no reference; N = the batch's response tokens. Â_i = α(r_i − mean_g r)/F_norm, F_norm = 1,
    α = B/(B − M), M the samples in groups whose rewards are all equal (no gradient; α
    rescales the others: the paper's accurate gradient estimation, AMAP-ML/GPG's
    adjust_gd). verl's compute_gpg_outcome_advantage instead takes α = B/#{i: r_i ≠ 0}
    and a group mean of 0 for one-sample groups. GPG also resamples until half the groups
    carry signal (min_inverse_alpha = 0.5): the controller's dynamic sampling.
    """
    return AlgorithmConfig.preset("gpg")


def grpo_dual_clip() -> AlgorithmConfig:
    """GRPO with dual-clip PPO (Ye et al. 2020, 'Mastering Complex Control in MOBA Games with
    Deep RL'), at verl's default c = 3 (clip_ratio_c).

    J = 1/B Σ_i 1/|y_i| Σ_t [ℓ_t − β D_KL^{k3}], ℓ_t = min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i)
    for Â_i ≥ 0 and max(min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i), c·Â_i) for Â_i < 0: a
    negative-advantage token whose ratio exceeds c contributes the constant c·Â_i and no
    gradient (M = 0), so one stale, unlikely token cannot push the update without bound.
    ε = 0.2, β = 0.04, c = 3, otherwise GRPO.
    """
    return AlgorithmConfig.preset("grpo_dual_clip")


def clip_cov() -> AlgorithmConfig:
    """Clip-Cov (Cui et al. 2025, 'The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models'), in the authors' verl recipe (recipe/entropy, 7B).

    cov_t = (log π_θ(y_t) − mean log π_θ)(Â_t − mean Â) over the batch's N response tokens;
    I = max(⌊r·N⌋, 1) tokens drawn uniformly from {t : ω_low < cov_t < ω_high, not clipped}
    (deterministic: the draw's key is the trainer step). J = 1/N Σ_{t∉I} min(r_t Â_t,
    clip(r_t, 1−ε, 1+ε) Â_t): the tokens in I carry neither value nor gradient (M = 0).
    r = 2e-4, [ω_low, ω_high] = [1, 5], ε = 1 (the recipe's wide clip), Â as GRPO, token
    mean, no KL.
    """
    return AlgorithmConfig.preset("clip_cov")


def kl_cov() -> AlgorithmConfig:
    """KL-Cov (Cui et al. 2025), in the authors' verl recipe (recipe/entropy, 7B).

    cov_t as Clip-Cov's; I_KL = the max(⌊k·N⌋, 1) tokens of largest cov_t;
    J = 1/N Σ_t [r_t Â_t − κ·1[t ∈ I_KL]·|log π_θ(y_t) − log π_old(y_t)|], unclipped
    (M = 1), k = 2e-3, κ = 1, Â as GRPO, token mean, no KL to π_ref. The penalty's gradient,
    −κ·sign(log π_θ − log π_old)·∇log π_θ, pulls the selected tokens back to π_old.
    """
    return AlgorithmConfig.preset("kl_cov")


def gmpo() -> AlgorithmConfig:
    """GMPO (Zhao et al. 2025, 'Geometric-Mean Policy Optimization'; verl's geo_mean).

    J = 1/B Σ_i Â_i·exp(1/|y_i| Σ_t sgn(Â_i)·min(sgn(Â_i)·log r_t, sgn(Â_i)·clip(log r_t,
    −ε_low, ε_high))), ε = 0.4 in log space (r ∈ (e^−0.4, e^0.4)), Â as GRPO, no KL: the
    geometric mean of the token ratios, each clipped on the side Â pushes it. ∇J =
    1/B Σ_i Â_i G_i 1/|y_i| Σ_t M_t ∇log π_θ(y_t): w = 1/(B|y_i|), ρ = G_i (the clipped
    geometric mean), M = sequence_log_clip (0 on clipped tokens).
    """
    return AlgorithmConfig.preset("gmpo")


def sapo() -> AlgorithmConfig:
    """SAPO (Gao et al. 2025, 'Soft Adaptive Policy Optimization', Qwen team; verl's sapo).

    J = 1/B Σ_i 1/|y_i| Σ_t f_{i,t}(r_t) Â_i, f(r) = σ(τ(r − 1))·4/τ with τ = τ_pos = 1 for
    Â > 0 and τ = τ_neg = 1.05 otherwise: a smooth gate in place of PPO's hard clip, Â as
    GRPO, no KL. ∇J = 1/B Σ_i 1/|y_i| Σ_t r_t·4σ(1 − σ)·Â_i ∇log π_θ(y_t): ρ = sg(r_t),
    M = token_soft_gate (4σ(τ(r−1))(1 − σ(τ(r−1))), 1 at r = 1).
    """
    return AlgorithmConfig.preset("sapo")


def trajectory_balance() -> AlgorithmConfig:
    """Trajectory balance with asynchrony (Bartoldson et al. 2025, Eqs. 4–5).

    L = 1/(BK) Σ (sg[log Ẑ(x)] + log π_θ(y) − log π_ref(y) − r(y)/β)²,
    log Ẑ(x) = 1/K Σ_j [log π_ref(y_j) − log π_θ(y_j) + r_j/β]; β 0.012 → 0.004 linearly
    by step 500 (GSM8K, Table 2); kl.reference_reset_every = ρ (TBA-PRIME: 50, β = 0.005).
    A separate objective (`rlax_tpu.algorithms.trajectory_balance`).
    """
    return AlgorithmConfig.preset("trajectory_balance")


def online_dpo() -> AlgorithmConfig:
    """Online DPO (Noukhovitch et al. 2024; Rafailov et al. 2023).

    L = −log σ(β[log π_θ(y₊)/π_ref(y₊) − log π_θ(y₋)/π_ref(y₋)]) per group, y₊/y₋ the best/
    worst of its K samples, β = 0.1, frozen reference. A separate objective
    (`rlax_tpu.algorithms.dpo`).
    """
    return AlgorithmConfig.preset("online_dpo")


PRESETS: dict[str, Callable[[], AlgorithmConfig]] = {
    "reinforce": reinforce,
    "rloo": rloo,
    "proximal_rloo": proximal_rloo,
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_batch": reinforce_pp_batch,
    "reinforce_pp_return_to_go": reinforce_pp_return_to_go,
    "ppo": ppo,
    "aipo": aipo,
    "remax": remax,
    "opo": opo,
    "gpg": gpg,
    "grpo_dual_clip": grpo_dual_clip,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "gmpo": gmpo,
    "sapo": sapo,
    "trajectory_balance": trajectory_balance,
    "online_dpo": online_dpo,
}


def preset(name: str, **overrides) -> AlgorithmConfig:
    """The preset `name` with `overrides` (validated; unknown names list the valid ones)."""
    return AlgorithmConfig.preset(name, **overrides)
