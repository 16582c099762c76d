"""Open registries: objective parts and presets of the user's own, without editing the package.

A plugin is a module of the user's, named in the config (`trainer.algorithm.plugins`, a
dotted module name or a path to a .py file); validating the config imports it, in every
process that reads the config (the trainer among them), and it registers what it defines:

    import jax.numpy as jnp
    from rlax_tpu.algorithms import register_part, register_preset

    @register_part("advantage", "median_baseline",
                   formula="A_i = r_i − median_g r", source="my team's notes")
    def median_baseline(p, c):          # p: PartInputs, c: the resolved AlgorithmConfig
        ...                              # float[batch, seq], zero off the response
        return advantages

    register_preset("grpo_median", base="grpo", advantage="median_baseline")

Then `--set trainer.algorithm.plugins=my_parts.py --set trainer.algorithm=grpo_median` (or
`trainer.algorithm.advantage=median_baseline`) trains with it. A part has the signature of
the built-in parts of its kind (rlax_tpu.algorithms.parts); an importance weight or a
gradient mask is named `token_*` or `sequence_*`, the level of the ratio it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlax_tpu.algorithms import parts
from rlax_tpu.algorithms.parts import Part
from rlax_tpu.config import AlgorithmConfig

# Kind (the AlgorithmConfig field it fills) -> the registry of that kind.
REGISTRIES: dict[str, dict[str, Part]] = {
    "aggregation": parts.AGGREGATIONS,
    "importance_weight": parts.IMPORTANCE_WEIGHTS,
    "advantage": parts.ADVANTAGES,
    "gradient_mask": parts.GRADIENT_MASKS,
    "kl_estimator": parts.KL_ESTIMATORS,
}


class RegistrationError(ValueError):
    """A part or preset that cannot be registered; the message says why and what to do."""


def register_part(
    kind: str, name: str, *, formula: str, source: str
) -> Callable[[Callable], Callable]:
    """A decorator registering a function as the part `name` of `kind` (one of REGISTRIES'
    keys), with the formula it computes and where it is from (shown by `describe` and the
    docs' tables). Registering the same function again is a no-op (a module imported
    twice); another function under a taken name is refused."""
    if kind not in REGISTRIES:
        raise RegistrationError(
            f"unknown part kind {kind!r}; the kinds are {', '.join(REGISTRIES)}"
        )
    if not name.isidentifier():
        raise RegistrationError(f"part name {name!r} must be a Python identifier")
    if kind in ("importance_weight", "gradient_mask") and name.split("_")[0] not in (
        "token",
        "sequence",
    ):
        raise RegistrationError(
            f"{kind} {name!r}: name it token_* or sequence_*, the level of the ratio it "
            "reads (the config checks that a mask and a weight read the same level)"
        )

    def decorator(fn: Callable) -> Callable:
        registry = REGISTRIES[kind]
        existing = registry.get(name)
        if existing is not None:
            if _same_function(existing.fn, fn):
                return fn
            raise RegistrationError(
                f"{kind} {name!r} is registered already (from {existing.source!r}); pick "
                "another name"
            )
        registry[name] = Part(name, fn, formula, source)
        AlgorithmConfig.register_part_name(kind, name)
        return fn

    return decorator


def register_preset(name: str, *, base: str = "grpo", **values: Any) -> AlgorithmConfig:
    """Register preset `name`: preset `base`'s values with `values` replacing some of them
    (fields of AlgorithmConfig: a part choice, or a part's section as a section or a dict,
    kl=KLConfig(beta=0.1); an old flat name such as kl_beta still works, with a warning).
    Returns it resolved (validated). A preset is a
    configuration of parts, so its parts must be registered before it."""
    from rlax_tpu.algorithms import presets

    try:
        config = AlgorithmConfig.register_preset(name, base=base, values=values)
    except ValueError as e:
        raise RegistrationError(f"preset {name!r}: {e}") from e
    presets.PRESETS.setdefault(name, lambda: AlgorithmConfig.preset(name))
    return config


def _same_function(a: Callable, b: Callable) -> bool:
    """The same function object, or the same source location (a file plugin run again)."""
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return a is b or (
        code_a is not None
        and code_b is not None
        and (code_a.co_filename, code_a.co_firstlineno)
        == (code_b.co_filename, code_b.co_firstlineno)
    )
