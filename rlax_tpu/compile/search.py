"""`rlax-tpu compile CONFIG --find-max KNOB`: the largest value of a batch knob that fits.

Memory grows with the trainer's micro-batch and with its sequence length, so the largest
value whose programs all fit (within FIT_FRACTION of HBM, and compiled without running out)
is found by bisection over the values the config accepts: every candidate probed is a real
compile of the programs the knob shapes (rl_step, recompute and, with a warm start,
sft_step), so a search costs about log2(candidates) of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from rlax_tpu.config import ConfigError, RunConfig

# What --find-max accepts: the knob, the programs it shapes.
KNOBS = {
    "micro_batch": ("trainer.micro_batch_size", ("rl_step", "recompute", "sft_step")),
    "max_seq_len": ("trainer.max_seq_len", ("rl_step", "recompute", "sft_step")),
}
SEQ_LEN_STEP = 256  # trainer.max_seq_len candidates are multiples of this


@dataclasses.dataclass
class SearchResult:
    knob: str  # the config field ("trainer.micro_batch_size")
    best: Any  # the largest value that fits (None: not even the smallest)
    tried: list[tuple[Any, bool, str]]  # (value, fits, why not) in probe order
    candidates: list[Any]

    @property
    def set_flag(self) -> str:
        return f"--set {self.knob}={self.best}" if self.best is not None else ""

    def to_json(self) -> dict:
        return {
            "knob": self.knob,
            "best": self.best,
            "candidates": self.candidates,
            "tried": [{"value": v, "fits": f, "why": w} for v, f, w in self.tried],
        }


def largest_fitting(
    candidates: Sequence[Any], fits: Callable[[Any], tuple[bool, str]]
) -> tuple[Any, list[tuple[Any, bool, str]]]:
    """Bisect ascending `candidates` for the last value `fits` accepts, assuming every value
    below a fitting one fits too; (that value or None, the probes made)."""
    tried: list[tuple[Any, bool, str]] = []
    low, high = 0, len(candidates) - 1  # the answer's index is in [low - 1, high]
    best = None
    while low <= high:
        middle = (low + high) // 2
        ok, why = fits(candidates[middle])
        tried.append((candidates[middle], ok, why))
        if ok:
            best, low = candidates[middle], middle + 1
        else:
            high = middle - 1
    return best, tried


def candidates(config: RunConfig, knob: str) -> list[int]:
    """The values of `knob` the config accepts, ascending."""
    if knob == "micro_batch":
        mini = config.trainer.mini_batch_size
        return [m for m in range(1, mini + 1) if mini % m == 0]
    if knob == "max_seq_len":
        inference = config.inference
        least = inference.max_prompt_len + inference.max_new_tokens
        most = config.model.max_position_embeddings
        steps = range(SEQ_LEN_STEP, most + 1, SEQ_LEN_STEP)
        return sorted({least, *(v for v in steps if v >= least)})
    raise ConfigError(f"--find-max {knob!r}: choose one of {', '.join(KNOBS)}")


def find_max(
    config: RunConfig, knob: str, *, compile_programs: Callable[[RunConfig, tuple], Any]
) -> SearchResult:
    """The largest value of `knob` at which `compile_programs(config, programs)` (a
    CompileReport) fits."""
    field, programs = KNOBS.get(knob, ("", ()))
    values = candidates(config, knob)
    if config.trainer.warm_start.steps == 0:
        programs = tuple(p for p in programs if p != "sft_step")

    def fits(value: int) -> tuple[bool, str]:
        try:
            probe = config.override(field, value)
        except ConfigError as e:
            return False, str(e)
        report = compile_programs(probe, programs)
        return report.fits, "; ".join(report.problems)

    best, tried = largest_fitting(values, fits)
    return SearchResult(field, best, tried, values)
