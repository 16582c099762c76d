"""The simulator's in-flight weight updates (inference.in_flight_update, staleness.InFlightPlan):
ticks of at most tick_tokens new tokens, continuations on the worker that paused them, and
what they cost ("resume" a prefill, "keep" a swap of KV pages), against "off"."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import Distribution, load_config
from rlax_tpu.simulator import Calibration, TimingModel, Workload, calibrate, generation_s, simulate
from rlax_tpu.staleness import InFlightPlan

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.py")
HEAVY = Distribution(kind="lognormal", median=6, sigma=1.5)
GEN_BOUND = TimingModel(train_fixed_s=0.01, train_s_per_token=0.0, decode_step_s=0.05)


def workload(
    mode: str = "off",
    *,
    n: int = 3,
    eta: int = 1,
    response: Distribution = HEAVY,
    steps: int = 12,
    workers: int = 2,
) -> Workload:
    """The tiny config with room for 48-token responses (T = 16 at N = 3, η = 1)."""
    config = load_config(
        TINY,
        [
            f"inference.in_flight_update={mode}",
            f"staleness.max_staleness={n}",
            f"staleness.reload_every={eta}",
            f"controller.num_steps={steps}",
            f"inference.num_workers={workers}",
            "controller.eval_dataset=",
            "inference.max_prompt_len=16",
            "inference.max_new_tokens=48",
        ],
    )
    calibration = Calibration()
    calibration.add_settings({"response_tokens": response.to_dict()})
    return calibrate(config, calibration)[0]


def test_off_predicts_what_it_did_before_in_flight_updates():
    """Figures of the simulator before the tick path existed (commit 193526e), exactly."""
    gen_bound = simulate(workload(), GEN_BOUND)
    assert gen_bound.wall_s == pytest.approx(30.51737165703855, rel=1e-12)
    assert gen_bound.warm_step_time_s == pytest.approx(2.5363652762942883, rel=1e-12)
    assert gen_bound.worker_busy_s == pytest.approx([29.345357802666673, 30.43898946133334])
    shared_host = simulate(workload(n=2, eta=2, workers=3), TimingModel(host_cores=2))
    assert shared_host.wall_s == pytest.approx(9.427855831064196, rel=1e-12)
    assert shared_host.warm_step_time_s == pytest.approx(0.749525853154964, rel=1e-12)


def test_no_tick_to_carry_into_is_off_exactly():
    """J = N - η = 0: the config's plan is None; a plan of no ticks through the tick path
    predicts the same to the last bit."""
    off = simulate(workload(), GEN_BOUND)
    assert workload("resume", n=1, eta=1).in_flight is None
    no_ticks = dataclasses.replace(workload(), in_flight=InFlightPlan("resume", 16, 0, 12))
    result = simulate(no_ticks, GEN_BOUND)
    assert result.continuations == 0
    assert result.summary() == off.summary()


@pytest.mark.parametrize("mode", ["resume", "keep"])
def test_responses_within_the_budget_never_pause(mode):
    short = Distribution(median=16)  # = T: every response ends in its first tick
    on = workload(mode, response=short)
    assert on.in_flight is not None and on.in_flight.tick_tokens == 16
    result = simulate(on, GEN_BOUND)
    assert result.continuations == 0
    assert result.summary() == simulate(workload(response=short), GEN_BOUND).summary()


@pytest.mark.parametrize("mode", ["resume", "keep"])
def test_in_flight_updates_raise_generation_throughput_on_a_heavy_tail(mode):
    """σ = 1.5: off waits each batch on its straggler; with ticks no call decodes more than
    T = 16 tokens of a request before its next tick."""
    off = simulate(workload(), GEN_BOUND)
    on = simulate(workload(mode), GEN_BOUND)
    assert on.continuations > 0
    assert on.tokens_generated == off.tokens_generated  # the same responses
    assert on.generation_tokens_per_s > 1.5 * off.generation_tokens_per_s
    assert on.warm_step_time_s < off.warm_step_time_s


def test_resume_pays_a_prefill_that_keep_does_not():
    """The same continuations (16 tokens so far, 8 new): resume prefills prompt + tokens so
    far; keep swaps the KV pages back in and prefills nothing."""
    no_prefill = dataclasses.replace(GEN_BOUND, prefill_call_s=0.0, prefill_s_per_token=0.0)
    prompts, new, done = [16] * 8, [8] * 8, [16] * 8

    def prefill_s(mode: str) -> float:
        w = workload(mode)
        return generation_s(GEN_BOUND, w, prompts, new, done) - generation_s(
            no_prefill, w, prompts, new, done
        )

    assert prefill_s("resume") > 0
    assert prefill_s("keep") == 0
    keep = workload("keep")
    slow_swap = dataclasses.replace(GEN_BOUND, kv_swap_bytes_per_s=1e6)
    assert generation_s(slow_swap, keep, prompts, new, done) > generation_s(
        GEN_BOUND, keep, prompts, new, done
    )


def test_continuations_prefill_at_powers_of_two_above_the_prefill_buckets():
    w = dataclasses.replace(workload(), prefill_buckets=(32, 64), max_seq_len=384)
    assert [w.continuation_bucket(n) for n in (20, 64, 65, 129, 300)] == [32, 64, 128, 256, 384]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    knobs=st.integers(1, 3).flatmap(lambda eta: st.tuples(st.just(eta), st.integers(eta, eta + 4))),
    workers=st.integers(1, 3),
    mode=st.sampled_from(["resume", "keep"]),
)
def test_every_token_is_generated_within_the_staleness_bound(knobs, workers, mode):
    eta, n = knobs
    w = workload(mode, n=n, eta=eta, workers=workers, steps=8)
    result = simulate(w, GEN_BOUND)
    assert result.steps == 8
    assert set(result.token_staleness) <= set(range(n + 1))
    assert result.tokens_generated == sum(result.token_staleness.values())
    assert result.rollouts_generated == 8 * w.batch_size


def test_cli_sets_the_in_flight_mode_against_off(tmp_path, capsys):
    out = tmp_path / "sim.json"
    overrides = ["inference.in_flight_update=keep", "staleness.max_staleness=3"]
    overrides += ["staleness.reload_every=1", "controller.num_steps=6"]
    args = ["simulate", TINY, "--json", str(out)]
    assert cli_main(args + [x for o in overrides for x in ("--set", o)]) == 0
    assert "in-flight updates (keep) against off" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["run"]["in_flight_update"] == "keep"
    assert math.isfinite(figures["speedup_in_flight_vs_off"])
    assert figures["in_flight"]["steps_per_s"]["ratio"] == figures["speedup_in_flight_vs_off"]
