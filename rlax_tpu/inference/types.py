"""What the controller and an inference worker exchange (DESIGN §4): per-request sampling
parameters, a generation request, a finished rollout, the result of a weight load. Plain
dataclasses with no JAX, so the controller and the worker client import them cheaply; the
engine, the worker and the gRPC layer all speak them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlax_tpu.config import InferenceConfig

FinishReason = str  # "stop" | "length" | "aborted" | "error"
LogprobsOf = Literal["full", "sampled"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults for a worker: `SamplingParams.from_config(cfg)`.

    temperature: 0 = greedy (argmax). top_k: 0 = off. top_p: 1 = off. Top-k is applied
    first, then top-p on the top-k renormalised distribution (the smallest set of most
    likely tokens whose mass reaches top_p; the most likely token is always kept).
    logprobs_of: which distribution the returned behaviour log-probs are of —
      "full":    log softmax(logits / temperature), the whole temperature-scaled distribution;
      "sampled": the top-k/top-p truncated, renormalised distribution actually sampled from.
    At temperature 0 both are computed as at temperature 1 (a greedy token's point mass
    would say nothing): "full" is then log softmax(logits), what a trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    logprobs_of: LogprobsOf = "full"

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs_of not in ("full", "sampled"):
            raise ValueError(f"logprobs_of must be 'full' or 'sampled', got {self.logprobs_of!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_config(cls, config: InferenceConfig) -> SamplingParams:
        return cls(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_new_tokens=config.max_new_tokens,
            stop_token_ids=config.stop_token_ids,
            logprobs_of=config.logprobs_of,
        )


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate. (prompt_id, sample_index) with the model version and the
    engine seed fix the PRNG key, so the same request always gives the same rollout."""

    request_id: str
    prompt_id: str
    sample_index: int
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams | None = None  # None = the engine's defaults (from the config)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A finished request.

    tokens: the response (a stop token that ended it included); logprobs: the behaviour
    log-prob of each response token under the distribution named by the request's
    `SamplingParams.logprobs_of` ("full": temperature-scaled full softmax; "sampled": the
    top-k/top-p truncated, renormalised one); version: the model version that generated
    every token. finish_reason: "stop" (a stop token), "length" (max_new_tokens or the
    slot's maximum sequence length), "aborted" (weights reloaded mid-flight; tokens so far
    are kept but must be regenerated), "error" (see `error`; nothing was generated).
    """

    request_id: str
    prompt_id: str
    sample_index: int
    version: int
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    error: str = ""


@dataclasses.dataclass(frozen=True)
class LoadResult:
    version: int  # the version now held
    already_loaded: bool  # it was held before the call: nothing changed
    aborted: tuple[Rollout, ...]  # in-flight requests ended by the swap (also sent to callers)
