"""How the training forward spends memory: a small, hashable value the trainer builds once
from its config and passes (statically) to every jitted forward. Inference does not use it."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from rlax_tpu.config import TrainerConfig

# The attention a training forward runs: the float32-scores reference, Pallas splash
# attention (TPU; interpreted elsewhere), or jax.nn.dot_product_attention (cuDNN on GPU).
TrainAttention = Literal["reference", "splash", "dot_product"]


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """remat_policy: what each decoder layer saves for the backward pass (TrainerConfig);
    attention: the resolved training attention; logprob_chunk_size: tokens per chunk of the
    log-prob / entropy head (0 = all at once)."""

    remat_policy: str = "none"
    attention: TrainAttention = "reference"
    logprob_chunk_size: int = 0

    @classmethod
    def from_trainer(cls, trainer: TrainerConfig, *, platform: str | None = None) -> ForwardOptions:
        """The options of `trainer`, its attention_backend resolved for `platform` (default:
        JAX's default backend): auto is splash on TPU, dot_product on GPU, reference on CPU."""
        return cls(
            remat_policy=trainer.remat_policy,
            attention=resolve_train_attention(trainer.attention_backend, platform=platform),
            logprob_chunk_size=trainer.logprob_chunk_size,
        )


def resolve_train_attention(name: str, *, platform: str | None = None) -> TrainAttention:
    """ "auto" | "jax" | "pallas" (TrainerConfig.attention_backend) -> the attention to run."""
    if name == "jax":
        return "reference"
    if name == "pallas":
        return "splash"
    if name != "auto":
        raise ValueError(f"attention_backend must be 'auto', 'jax' or 'pallas', got {name!r}")
    platform = platform or jax.default_backend()
    return {"tpu": "splash", "gpu": "dot_product"}.get(platform, "reference")


# The reference behaviour (no remat, reference attention, unchunked head): the default of
# every forward that is not given options.
REFERENCE = ForwardOptions()
