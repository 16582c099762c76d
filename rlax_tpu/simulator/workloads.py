"""The inference benchmark's workload, defined once: tools/bench_inference.py runs it and the
simulator's calibration (`model._from_inference_bench`) reads the benchmark's measurements
against it, so the two cannot drift apart. Configs and lengths only (no JAX).

The workload: a tiny model (`MODEL`) served with `INFERENCE`; request lengths heavy-tailed
and fixed by the seed — prompts lognormal with median 24 tokens (σ 0.8, within [4,
max_prompt_len]), outputs lognormal with median 32 (σ 1.0, within [1, max_new_tokens]),
each output length the request's own max_new_tokens. `RL_INFERENCE` is the second case: one
RL batch of RL_PROMPTS × RL_SAMPLES, all in flight at once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_tpu.config import InferenceConfig, ModelConfig

SEED = 0
MODEL = ModelConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
)
INFERENCE = InferenceConfig(
    max_decode_slots=8,
    page_size=16,
    kv_cache_bytes=32 * 2**20,
    prefill_buckets=(16, 32, 64, 128),
    max_prompt_len=128,
    max_new_tokens=256,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
)
# One RL batch: every sample of the batch has a slot, as in a rollout worker.
RL_PROMPTS, RL_SAMPLES = 8, 8
RL_INFERENCE = dataclasses.replace(
    INFERENCE, max_decode_slots=RL_PROMPTS * RL_SAMPLES, max_new_tokens=16
)

PROMPT_MEDIAN, PROMPT_SIGMA = 24, 0.8
OUTPUT_MEDIAN, OUTPUT_SIGMA = 32, 1.0


def draw_lengths(rng: np.random.Generator, requests: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, output lengths) of `requests` requests, drawn from `rng` (the
    benchmark draws the prompts' tokens from the same generator afterwards)."""
    prompts = np.clip(
        rng.lognormal(np.log(PROMPT_MEDIAN), PROMPT_SIGMA, requests), 4, INFERENCE.max_prompt_len
    )
    outputs = np.clip(
        rng.lognormal(np.log(OUTPUT_MEDIAN), OUTPUT_SIGMA, requests), 1, INFERENCE.max_new_tokens
    )
    return [int(p) for p in prompts], [int(o) for o in outputs]


def lengths(requests: int, seed: int = SEED) -> tuple[list[int], list[int]]:
    """The benchmark's (prompt lengths, output lengths) for `requests` requests."""
    return draw_lengths(np.random.default_rng(seed), requests)


def prefill_bucket(prompt_len: int) -> int:
    """The prefill bucket a prompt of `prompt_len` tokens is padded to."""
    return next(b for b in INFERENCE.prefill_buckets if b >= prompt_len)
