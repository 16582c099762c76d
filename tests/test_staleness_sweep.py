"""tools/staleness_sweep.py's report over seeds, on synthetic run results (the sweep itself
runs minutes per run: docs/data.md has its figures), and its variants' configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlax_tpu.verifiers.functions import load_reward_function

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
    interval = sweep.bootstrap_interval([-0.1, -0.2])
    assert table[2] == (
        "| GRPO | 2 | 0.850 [0.800–0.900] | 0.700 [0.700–0.700] | -0.150 [-0.200–-0.100] "
        f"| [{interval[0]:+.3f}, {interval[1]:+.3f}] | – | – "
        "| 0.500 [0.500–0.500] | 0.500 [0.500–0.500] |"
    )
    assert table[3].startswith("| online DPO | 2 | 0.620 [0.600–0.640] | 0.610 [0.600–0.620]")
    assert table[3].endswith("| 1.500 [1.000–2.000] | 3.500 [3.000–4.000] |")


def test_one_seed_gives_plain_figures_and_no_interval():
    one = [r for r in RESULTS if r["seed"] == 0]
    row = sweep.markdown_table(one, ["grpo"], [0, 16]).splitlines()[2]
    assert row == "| GRPO | 1 | 0.800 | 0.700 | -0.100 | – | – | – | 0.500 | 0.500 |"


def test_the_bootstrap_interval_is_of_the_mean_and_reproducible():
    values = [-0.05, -0.02, -0.08, 0.01, -0.04, -0.06, -0.03, -0.07, 0.0, -0.05]
    low, high = sweep.bootstrap_interval(values)
    mean = sum(values) / len(values)
    assert low < mean < high and high < 0  # every resample's mean is negative here
    assert sweep.bootstrap_interval(values) == [low, high]
    # About mean ± 1.96 standard errors for ten roughly normal values.
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    assert high - low == pytest.approx(2 * 1.96 * sd / len(values) ** 0.5, rel=0.25)
    assert sweep.bootstrap_interval([0.1]) is None


def seeds_of(algorithm: str, changes: list[float], start: float = 0.8) -> list[dict]:
    return [
        r
        for seed, change in enumerate(changes)
        for r in (
            result(algorithm, 0, seed, start) | {"drift": 0.01},
            result(algorithm, 16, seed, start + change) | {"drift": 0.05},
        )
    ]


def test_the_reading_says_only_what_the_intervals_support():
    losing = [-0.05, -0.04, -0.06, -0.05, -0.03, -0.07, -0.05, -0.04, -0.06, -0.05]
    noisy = [0.05, -0.06, 0.02, -0.03, 0.04, -0.05, 0.01, -0.02, 0.03, 0.0]
    results = seeds_of("grpo", losing) + seeds_of("online_dpo", noisy)
    text = sweep.reading(results, ["grpo", "online_dpo"], [0, 16])
    assert "GRPO: -0.050 [" in text and "over 10 seeds: loses accuracy" in text
    assert "online DPO: -0.001 [" in text and text.count("not resolved") == 1
    assert "GRPO − online DPO: -0.049 [" in text and "GRPO loses more to staleness" in text
    found = sweep.analysis(results, ["grpo", "online_dpo"], [0, 16])
    grpo = found["objectives"]["grpo"]
    assert grpo["drift"] == {"0": 0.01, "16": 0.05}
    assert grpo["per_unit_drift"] == pytest.approx(-0.05 / 0.04)
    assert grpo["per_seed"]["3"] == pytest.approx(-0.05)


def test_the_study_is_kept_run_by_run_and_extended(tmp_path):
    base = sweep.sweep_config(quick=True, steps=None, extra=[])
    path = tmp_path / "study.json"
    store = {(r["algorithm"], r["max_staleness"], r["seed"]): r for r in RESULTS}
    sweep._write(path, sweep.report(store, base, ["x=1"], quick=True))
    study = json.loads(path.read_text())
    assert study["seeds"] == [0, 1] and study["algorithms"] == ["grpo", "online_dpo"]
    assert len(study["runs"]) == len(RESULTS)
    assert study["analysis"]["objectives"]["grpo"]["per_seed"] == pytest.approx(
        {"0": -0.1, "1": -0.2}
    )
    assert sweep.load_store(path) == store  # read back: these cells are not run again
    assert sweep.parse_seeds("0-3,7,2") == (0, 1, 2, 3, 7)


def test_the_graded_reward_ranks_wrong_answers_and_keeps_exact_ones_at_one():
    graded = sweep.run_config(
        sweep.sweep_config(quick=False, steps=None, extra=[]), "online_dpo_graded", 16, Path()
    )
    (dataset,) = graded.controller.datasets
    assert dataset.verifier == "function" and dataset.reward_function == sweep.GRADED_REWARD
    reward = load_reward_function(sweep.GRADED_REWARD)
    score = {r: reward("", r, "100", {})["reward"] for r in ("100", "101", "110", "7", "none")}
    assert score["100"] == 1.0 and score["none"] == 0.0
    assert 0.5 > score["101"] > score["110"] > score["7"] >= 0.0


def test_the_variants_are_grpo_with_dual_clip_and_with_tis_on_a_recomputed_pi_old(tmp_path):
    base = sweep.sweep_config(quick=True, steps=None, extra=[])
    dual = sweep.run_config(base, "grpo_dual_clip", 4, tmp_path).trainer
    assert dual.algorithm.resolved().clip.dual_c == 3.0
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
    assert tb.trainer.algorithm.resolved().kl.reference_reset_every == sweep.TBA_RESET_EVERY
    prime = sweep.run_config(base, "tba_prime", 16, tmp_path).trainer.algorithm.resolved()
    assert (prime.importance_weight, prime.importance.rho_max, prime.advantage) == (
        "token_truncated",
        8.0,
        "group_mean",
    )
    assert prime.gradient_mask == "keep_all" and prime.aggregation == "sequence_sum"
    assert prime.kl.in_reward and prime.kl_estimator == "k1" and prime.kl.beta == 0.005
    assert prime.kl.reference_reset_every == sweep.TBA_RESET_EVERY
    for name, k in (("online_dpo_k4", 4), ("online_dpo_k2", 2)):
        config = sweep.run_config(base, name, 16, tmp_path)
        config.validate()
        assert config.controller.samples_per_prompt == k
        assert config.controller.global_batch_size == base.controller.global_batch_size
        assert sweep.warm_start_key(config) == sweep.warm_start_key(base)
        assert config.trainer.algorithm.resolved().kl.beta == 0.1
    # TB as TBA runs it: a few nats of reward scale, the replay buffer, the reference reset.
    tba = sweep.run_config(base, "tb_tba", 16, tmp_path)
    tba.validate()
    algorithm = tba.trainer.algorithm.resolved()
    assert 1 / algorithm.kl.beta == pytest.approx(3.33, abs=0.01)
    assert algorithm.kl.beta_final == algorithm.kl.beta
    assert algorithm.kl.reference_reset_every == sweep.TBA_RESET_EVERY
    assert tba.controller.replay.enabled and tba.controller.replay.recency_prob == 0.5
    graded = sweep.run_config(base, "online_dpo_graded", 16, tmp_path)
    graded.validate()
    assert sweep.warm_start_key(graded) == sweep.warm_start_key(base)  # paired


def test_warm_start_keys_are_those_of_before_the_configs_were_nested():
    """A study resumes from its cached warm starts: the key of the demo config at seeds 0 and
    1 is what the sweep computed before trainer.optimizer / trainer.warm_start existed
    (the directories warm_start-<key> of a study started then), and an SFT setting still
    changes it."""
    from rlax_tpu.config import load_config

    tiny = str(ROOT / "configs" / "tiny_cpu.py")
    assert sweep.warm_start_key(load_config(tiny, ["seed=0"])) == "8be884569ab8"
    assert sweep.warm_start_key(load_config(tiny, ["seed=1"])) == "2c91df6952e1"
    longer = load_config(tiny, ["seed=0", "trainer.warm_start.steps=1601"])
    assert sweep.warm_start_key(longer) != "8be884569ab8"


def test_the_long_variants_train_three_times_the_steps_from_the_same_warm_start(tmp_path):
    """The 'more steps' condition of issue 36: each compared objective at LONG_STEPS, its
    algorithm and warm start unchanged (so N = 16's SFT-era share of updates shrinks)."""
    base = sweep.sweep_config(quick=False, steps=None, extra=[])
    for name in sweep.LONG:
        preset = name[: -len("_long")]
        long, plain = (sweep.run_config(base, a, 16, tmp_path / a) for a in (name, preset))
        long.validate()
        assert long.controller.num_steps == sweep.LONG_STEPS == 3 * plain.controller.num_steps
        assert long.trainer.algorithm == plain.trainer.algorithm
        assert sweep.warm_start_key(long) == sweep.warm_start_key(plain)
