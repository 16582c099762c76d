"""What a compiled program costs in time: model FLOPs against compiled FLOPs, MFU, and the step
time to plan with.

Model FLOPs are the analytic count of the work the architecture must do on the program's
tokens (rlax_tpu.simulator.model's arithmetic, the count the benchmarks and the simulator use):
6·N + 6·layers·heads·head_dim·seq per trained token, a third of it per token of a forward
pass (π_old, the reference, a prefill), and per decoded token 2·N plus attention over a
context of half the sequence limit. Compiled FLOPs are what the compiled HLO does
(rlax_tpu.compile.hlo_cost: remat's recomputation and every extra pass included). MFU is
model FLOPs over peak FLOPs × time, at two times: the roofline (max of FLOPs/peak and
HBM bytes/bandwidth, a lower bound no run beats) and the estimated time, the roofline over the
stated efficiency a run reaches of it (STATED_EFFICIENCY, the simulator's defaults: the same
guesses `rlax-tpu simulate` makes). Programs that do no model work (start-up, publish, swap
copies) have a time but no MFU.
"""

from __future__ import annotations

from typing import Any

from rlax_tpu.config import RunConfig
from rlax_tpu.hardware import STATED_EFFICIENCY, ChipSpec

# Which stated efficiency each program's time is estimated at.
EFFICIENCY_OF = {
    "init": "train",
    "init_opt": "train",
    "rl_step": "train",
    "recompute": "train",
    "sft_step": "train",
    "publish": "train",
    "prefill": "prefill",
    "extend": "prefill",
    "decode": "decode",
    "swap_out": "decode",
    "swap_in": "decode",
}


def model_flops(name: str, dims: dict[str, int], config: RunConfig) -> float:
    """The architecture's FLOPs for one call of program `name` at `dims` (all chips
    together); 0 for a program that does no model work."""
    from rlax_tpu.simulator.model import decode_flops_per_token, train_flops_per_token

    model = config.model
    if name in ("rl_step", "sft_step"):
        return train_flops_per_token(model, dims["seq_len"]) * dims["rows"] * dims["seq_len"]
    if name == "recompute":
        return train_flops_per_token(model, dims["seq_len"]) / 3 * dims["rows"] * dims["seq_len"]
    if name in ("prefill", "extend"):  # extend: its fed tokens (attention to the pages aside)
        return train_flops_per_token(model, dims["seq_len"]) / 3 * dims["rows"] * dims["seq_len"]
    if name == "decode":
        per_token = decode_flops_per_token(model, dims["max_seq_len"] / 2)
        return per_token * dims["slots"] * dims["steps"]
    return 0.0


def program_cost(
    name: str,
    dims: dict[str, int],
    compiled_flops: float,
    roofline_s: float,
    *,
    config: RunConfig,
    chip: ChipSpec,
    num_chips: int,
) -> dict[str, Any]:
    """Per chip, per call: model and compiled FLOPs, MFU at the roofline and at the stated
    efficiency, and the estimated time."""
    efficiency = STATED_EFFICIENCY[EFFICIENCY_OF[name]]
    model = model_flops(name, dims, config) / num_chips
    estimated_s = roofline_s / efficiency if roofline_s else 0.0
    out: dict[str, Any] = {
        "model_flops": model,
        "compiled_over_model": compiled_flops / model if model else None,
        "efficiency": efficiency,
        "estimated_s": estimated_s,
        "mfu_at_roofline": None,
        "mfu_estimated": None,
    }
    if model and roofline_s:
        out["mfu_at_roofline"] = model / (roofline_s * chip.peak_flops_per_s)
        out["mfu_estimated"] = model / (estimated_s * chip.peak_flops_per_s)
    return out


def train_step_cost(programs: list[Any], config: RunConfig, chip: ChipSpec) -> dict | None:
    """One train step (recompute × its calls + rl_step): per chip, the model FLOPs of training
    the batch against what the compiled programs do, where the extra goes (remat and the rest
    of rl_step beyond 6·N per token, π_old, the reference pass), its roofline, estimated time
    and MFU. None unless both programs compiled."""
    by_name = {p.name: p for p in programs}
    rl, recompute = by_name.get("rl_step"), by_name.get("recompute")
    if rl is None or recompute is None or rl.error or recompute.error:
        return None
    model = rl.cost["model_flops"]
    roofline = rl.roofline_s + recompute.roofline_s * recompute.calls_per_step
    estimated = roofline / STATED_EFFICIENCY["train"]
    compiled = rl.flops + recompute.flops * recompute.calls_per_step
    extra = {
        "rl_step_beyond_model": rl.flops - model,  # remat's recomputation, the loss, Adam
        "pi_old": recompute.flops,
        "reference": recompute.flops * (recompute.calls_per_step - 1),
    }
    return {
        "model_flops": model,
        "compiled_flops": compiled,
        "compiled_over_model": compiled / model if model else None,
        "extra_flops": extra,
        "roofline_s": roofline,
        "estimated_s": estimated,
        "efficiency": STATED_EFFICIENCY["train"],
        "mfu_at_roofline": model / (roofline * chip.peak_flops_per_s) if roofline else None,
        "mfu_estimated": model / (estimated * chip.peak_flops_per_s) if roofline else None,
    }
