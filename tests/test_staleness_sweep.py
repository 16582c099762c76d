"""tools/staleness_sweep.py's report over seeds, on synthetic run results (the sweep itself
runs minutes per run: docs/data.md has its figures), and its variants' configs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import staleness_sweep as sweep  # noqa: E402


def result(algorithm, n, seed, accuracy, kl=0.5):
    return {
        "algorithm": algorithm,
        "max_staleness": n,
        "seed": seed,
        "final_accuracy": accuracy,
        "kl_to_reference": kl,
        "kl_to_reference_stderr": 0.01,
    }


# GRPO loses 0.10 and 0.20 with N; online DPO gains 0.02 and loses 0.04: means −0.15, −0.01.
RESULTS = [
    result("grpo", 0, 0, 0.80),
    result("grpo", 16, 0, 0.70),
    result("grpo", 0, 1, 0.90),
    result("grpo", 16, 1, 0.70),
    result("online_dpo", 0, 0, 0.60, kl=1.0),
    result("online_dpo", 16, 0, 0.62, kl=3.0),
    result("online_dpo", 0, 1, 0.64, kl=2.0),
    result("online_dpo", 16, 1, 0.60, kl=4.0),
]


def test_the_table_gives_the_mean_and_range_over_seeds_and_the_mean_change():
    table = sweep.markdown_table(RESULTS, ["grpo", "online_dpo"], [0, 16]).splitlines()
    assert table[2] == (
        "| GRPO | 0.850 [0.800–0.900] | 0.700 [0.700–0.700] | -0.150 [-0.200–-0.100] "
        "| 0.500 [0.500–0.500] | 0.500 [0.500–0.500] |"
    )
    assert table[3].startswith("| online DPO | 0.620 [0.600–0.640] | 0.610 [0.600–0.620] | -0.010")
    assert table[3].endswith("| 1.500 [1.000–2.000] | 3.500 [3.000–4.000] |")


def test_one_seed_gives_plain_figures():
    one = [r for r in RESULTS if r["seed"] == 0]
    row = sweep.markdown_table(one, ["grpo"], [0, 16]).splitlines()[2]
    assert row == "| GRPO | 0.800 | 0.700 | -0.100 | 0.500 | 0.500 |"


def test_the_reading_orders_by_the_mean_change_and_scales_the_noise_by_the_seeds():
    text = sweep.reading(RESULTS, ["grpo", "online_dpo"], [0, 16], size=512)
    assert "(most robust first): online DPO -0.010 [-0.040–+0.020], GRPO -0.150" in text
    p = sum(r["final_accuracy"] for r in RESULTS) / len(RESULTS)
    noise = float(text.split("standard error of about ")[1].split(" ")[0])
    assert noise == pytest.approx((2 * p * (1 - p) / 512 / 2) ** 0.5, abs=0.0005)


def test_the_variants_are_grpo_with_dual_clip_and_with_tis_on_a_recomputed_pi_old(tmp_path):
    base = sweep.sweep_config(quick=True, steps=None, extra=[])
    dual = sweep.run_config(base, "grpo_dual_clip", 4, tmp_path).trainer
    assert dual.algorithm.resolved().dual_clip_c == 3.0
    assert dual.behaviour_logprobs == "cached"
    tis = sweep.run_config(base, "grpo_tis", 4, tmp_path).trainer
    assert tis.algorithm.resolved().rollout_correction == "token_tis"
    assert tis.algorithm.resolved().name == "grpo"
    assert tis.behaviour_logprobs == "recomputed"


def test_the_paper_condition_variants_validate_and_keep_the_global_batch(tmp_path):
    """TBA's reference reset (on TB, and in TBA-PRIME with its min(λ, 8) weight and the k1
    KL folded into a group-mean advantage) and online DPO with 4 and 2 samples per prompt:
    each is a valid config whose warm start is the sweep's (same global batch)."""
    base = sweep.sweep_config(quick=False, steps=None, extra=[])
    tb = sweep.run_config(base, "tb_reset", 16, tmp_path)
    tb.validate()
    sweep.run_config(base, "tba_prime", 16, tmp_path).validate()
    assert tb.trainer.algorithm.resolved().reference_reset_every == sweep.TBA_RESET_EVERY
    prime = sweep.run_config(base, "tba_prime", 16, tmp_path).trainer.algorithm.resolved()
    assert (prime.importance_weight, prime.rho_max, prime.advantage) == (
        "token_truncated",
        8.0,
        "group_mean",
    )
    assert prime.gradient_mask == "keep_all" and prime.aggregation == "sequence_sum"
    assert prime.kl_in_reward and prime.kl_estimator == "k1" and prime.kl_beta == 0.005
    assert prime.reference_reset_every == sweep.TBA_RESET_EVERY
    for name, k in (("online_dpo_k4", 4), ("online_dpo_k2", 2)):
        config = sweep.run_config(base, name, 16, tmp_path)
        config.validate()
        assert config.controller.samples_per_prompt == k
        assert config.controller.global_batch_size == base.controller.global_batch_size
        assert sweep.warm_start_key(config) == sweep.warm_start_key(base)
        assert config.trainer.algorithm.resolved().kl_beta == 0.1
