"""An inference worker's KV capacity (rlax_tpu/inference/capacity.py): pool tokens and the
sequences it holds at once under reserve and on-demand admission, against hand computations."""

import math
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import pytest

from rlax_tpu.config import Distribution, InferenceConfig, ModelConfig, load_config
from rlax_tpu.inference.capacity import _token_moments, kv_capacity
from rlax_tpu.inference.page_allocator import num_pages_for_budget

ROOT = Path(__file__).resolve().parent.parent

# 2 (keys, values) × 2 layers × 2 kv heads × head_dim 16 × 4 bytes (float32) = 512 bytes a
# token; 8 KiB a page of 16 tokens.
MODEL = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
BYTES_PER_PAGE = 512 * 16


def _inference(**kwargs) -> InferenceConfig:
    # 100 pages and change: 99 usable (page 0 is padding), 1584 tokens. A worst-case sequence
    # is 32 + 64 tokens = 6 pages.
    defaults = dict(
        kv_cache_bytes=100 * BYTES_PER_PAGE + 100,
        page_size=16,
        max_prompt_len=32,
        prefill_buckets=(32,),
        max_new_tokens=64,
        max_decode_slots=64,
        prompt_tokens=Distribution(median=20),
        response_tokens=Distribution(median=40),
    )
    return InferenceConfig(**(defaults | kwargs))


def test_pool_and_reserved_sequences_match_a_hand_computation():
    c = kv_capacity(MODEL, _inference())
    assert c.bytes_per_token == 512
    assert c.usable_pages == 99 and c.tokens == 99 * 16
    # The pool is the one the engine allocates (num_pages_for_budget counts the padding page).
    pages = num_pages_for_budget(
        _inference().kv_cache_bytes,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        page_size=16,
        dtype="float32",
    )
    assert c.usable_pages == pages - 1
    assert c.reserved_tokens_per_sequence == 96
    assert c.concurrent_sequences_reserved == 99 // 6 == 16


def test_on_demand_counts_a_sequence_by_its_mean_live_kv():
    # Fixed lengths: a live sequence holds 20 + 40/2 tokens on average, + half a page.
    c = kv_capacity(MODEL, _inference())
    assert (c.expected_prompt_tokens, c.expected_response_tokens) == (20, 40)
    assert c.mean_live_tokens_per_sequence == 20 + 20 + 8
    assert c.concurrent_sequences_on_demand == 1584 // 48 == 33
    assert c.limited_by == "kv_pages"
    assert c.on_demand_over_reserved == 33 / 16


def test_long_responses_weigh_by_the_time_they_are_live():
    # Responses 8 or 56 tokens: E[L] = 32 but E[L²] / (2 E[L]) = (64 + 3136) / 2 / 64 = 25,
    # not 16: the long ones are live 7 times as long, so most live sequences are long.
    response = Distribution(kind="empirical", values=(8, 56))
    c = kv_capacity(MODEL, _inference(response_tokens=response))
    assert c.expected_response_tokens == 32
    assert c.mean_live_tokens_per_sequence == 20 + 25 + 8
    assert c.concurrent_sequences_on_demand == 1584 // 53 == 29


def test_expected_lengths_are_clipped_to_the_budgets():
    # A 70-token response stops at max_new_tokens (64); a 50-token prompt at max_prompt_len.
    response = Distribution(kind="empirical", values=(10, 70))
    c = kv_capacity(
        MODEL, _inference(prompt_tokens=Distribution(median=50), response_tokens=response)
    )
    assert (c.expected_prompt_tokens, c.expected_response_tokens) == (32, 37)


def test_concurrency_is_clipped_to_the_decode_slots():
    c = kv_capacity(MODEL, _inference(max_decode_slots=8))
    assert c.concurrent_sequences_reserved == c.concurrent_sequences_on_demand == 8
    assert c.limited_by == "decode_slots"


def test_a_pool_too_small_for_one_worst_case_sequence_reserves_none():
    c = kv_capacity(MODEL, _inference(kv_cache_bytes=5 * BYTES_PER_PAGE))
    assert c.concurrent_sequences_reserved == 0 and c.on_demand_over_reserved is None
    assert c.concurrent_sequences_on_demand == 64 // 48 == 1
    assert c.to_json()["on_demand_over_reserved"] is None


def test_the_figure_in_use_follows_kv_admission():
    assert kv_capacity(MODEL, _inference()).concurrent_sequences == 33
    reserve = kv_capacity(MODEL, _inference(kv_admission="reserve"))
    assert reserve.admission == "reserve" and reserve.concurrent_sequences == 16


@pytest.mark.parametrize("median, sigma, top", [(1024, 1.0, 14336), (1500, 0.4, 16384)])
def test_lognormal_moments_match_the_clipped_closed_form(median, sigma, top):
    # E[min(X, M)^k] of a lognormal: e^(kμ + k²σ²/2) Φ((ln M − μ − kσ²)/σ) + M^k P(X > M).
    phi, mu = NormalDist().cdf, math.log(median)

    def moment(k: int) -> float:
        z = (math.log(top) - mu) / sigma
        return math.exp(k * mu + k * k * sigma**2 / 2) * phi(z - k * sigma) + top**k * (1 - phi(z))

    d = Distribution(kind="lognormal", median=median, sigma=sigma, minimum=1, maximum=top)
    mean, mean_square = _token_moments(d)
    # Whole tokens (rounded up) add at most one to a draw.
    assert moment(1) <= mean <= moment(1) + 1
    assert mean_square / (2 * mean) == pytest.approx(moment(2) / (2 * moment(1)), rel=1e-3)


def test_the_8b_config_holds_over_four_times_more_sequences_on_demand():
    config = load_config(str(ROOT / "configs" / "llama3_1_8b_tpu_v5p_64.py"))
    c = kv_capacity(config.model, config.inference)
    # 48 GiB of 128 KiB tokens: 6143 usable pages of 64; 256 pages a worst-case sequence.
    assert (c.tokens, c.concurrent_sequences_reserved) == (6143 * 64, 23)
    assert c.admission == "on_demand"
    assert c.concurrent_sequences_on_demand >= 4 * c.concurrent_sequences_reserved


def test_capacity_imports_no_jax():
    code = "import sys, rlax_tpu.inference.capacity; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
