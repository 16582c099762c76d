"""Weights for tests that need a model's parameters but not a built model."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from rlax_tpu.models import Transformer


def model_params(config, seed: int) -> dict:
    """Random weights shaped like `config.model`'s (norm scales 1, matrices N(0, 0.02²) as
    in its init), drawn with numpy: building the Transformer eagerly takes seconds."""
    abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)

    def init(leaf):
        if leaf.ndim == 1:
            return np.ones(leaf.shape, leaf.dtype)
        return (0.02 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree.map(init, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
