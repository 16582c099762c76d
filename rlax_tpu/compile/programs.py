"""Every jitted program a run executes on its accelerators, ready to lower on abstract inputs.

The trainer's come from `TrainerPrograms` (the builder `Trainer` itself uses), the inference
worker's from an `Engine` built without device memory (`allocate=False`), so the programs
compiled here are the ones the run executes, at the shapes it executes them:

  trainer    rl_step     one train step's update of the global batch (prompts_per_batch ×
                         samples_per_prompt rows of trainer.max_seq_len tokens)
             recompute   π_old (and V_old) of the global batch, micro-batch by micro-batch;
                         run again on the reference params when the objective has a KL term
             sft_step    one SFT warm-start step (only when controller.sft_steps > 0)
  inference  prefill     inference.prefill_rows prompts of the largest prefill bucket
             decode      one decode call of all max_decode_slots slots: the largest of the
                         decode buckets the engine compiles (inference.decode_rows), the
                         one whose memory bounds the others
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from rlax_tpu.config import RunConfig
from rlax_tpu.sharding import use_mesh

COMPONENT_OF = {
    "rl_step": "trainer",
    "recompute": "trainer",
    "sft_step": "trainer",
    "prefill": "inference",
    "decode": "inference",
}
PROGRAMS = tuple(COMPONENT_OF)


@dataclasses.dataclass
class Program:
    """One jitted program of the run and how to lower it on abstract inputs.

    arguments: per-chip bytes of the arguments by what they are (params, optimizer_state,
    kv_cache); the compiler's other argument bytes are the batch and small inputs.
    gradients: per-chip bytes of the gradient tree the program builds (inside its
    temporaries: a param-shaped accumulator, float32 like the master params).
    """

    name: str
    component: str
    shape: str
    calls: str  # how often it runs
    calls_per_step: int  # per train step (trainer) or per call (inference)
    lower: Callable[[], jax.stages.Lowered]
    arguments: dict[str, int]
    gradients: int = 0
    # The shape as numbers: rows, seq_len (tokens per row), micro_batch, updates (trainer);
    # rows, seq_len (prefill); slots, steps, max_seq_len (decode).
    dims: dict[str, int] = dataclasses.field(default_factory=dict)


def per_chip_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def trainer_programs(config: RunConfig, mesh: jax.sharding.Mesh, names: set[str]) -> list[Program]:
    from rlax_tpu.trainer.programs import TrainerPrograms

    tp = TrainerPrograms(config, mesh)
    levels, seq = tp.levels, config.trainer.max_seq_len
    params = per_chip_bytes(tp.abstract_params)
    batch = (
        f"{levels.global_size} × {seq} tokens: {levels.num_updates} update(s) of "
        f"{levels.mini_size}, micro-batch {levels.micro_size}"
    )

    def lowering(fn, *args) -> Callable[[], jax.stages.Lowered]:
        def lower() -> jax.stages.Lowered:
            with use_mesh(mesh, tp.rules):
                return fn.lower(*args)

        return lower

    dims = {
        "rows": levels.global_size,
        "seq_len": seq,
        "micro_batch": levels.micro_size,
        "updates": levels.num_updates,
    }
    out = []
    if "rl_step" in names:
        out.append(
            Program(
                "rl_step",
                "trainer",
                batch,
                "once per train step",
                1,
                lowering(tp.rl_step, *tp.abstract_rl_step_args(seq)),
                {"params": params, "optimizer_state": per_chip_bytes(tp.rl.abstract)},
                gradients=params,
                dims=dims,
            )
        )
    if "recompute" in names:
        reference = tp.objective.needs_reference_logprobs
        values = tp.objective.needs_rollout_values
        out.append(
            Program(
                "recompute",
                "trainer",
                f"{levels.global_size} × {seq} tokens, micro-batch {levels.micro_size}",
                "twice per train step (π_old, reference)" if reference else "once per train step",
                2 if reference else 1,
                lowering(tp.recompute, tp.abstract_params, tp.abstract_tokens(seq), values),
                {"params": params},
                dims=dims,
            )
        )
    if "sft_step" in names and config.controller.sft_steps > 0:
        out.append(
            Program(
                "sft_step",
                "trainer",
                batch,
                f"once per SFT warm-start step ({config.controller.sft_steps})",
                1,
                lowering(tp.sft_step, *tp.abstract_sft_step_args(seq)),
                {"params": params, "optimizer_state": per_chip_bytes(tp.sft.abstract)},
                gradients=params,
                dims=dims,
            )
        )
    return out


def inference_programs(
    config: RunConfig, mesh: jax.sharding.Mesh, names: set[str]
) -> list[Program]:
    from rlax_tpu.inference.engine import Engine

    # As the worker builds it (rlax_tpu.inference.worker), without device memory.
    engine = Engine(config.model, config.inference, seed=config.seed, mesh=mesh, allocate=False)
    cache = engine.abstract_cache
    arguments = {
        "params": per_chip_bytes(engine.abstract_params()),
        "kv_cache": per_chip_bytes((cache.keys, cache.values)),
    }
    inference = config.inference
    bucket = inference.prefill_buckets[-1]
    out = []
    if "prefill" in names:
        out.append(
            Program(
                "prefill",
                "inference",
                f"{engine.prefill_rows} × {bucket} tokens (largest bucket), "
                f"{cache.num_pages} pages of {cache.page_size}, attention {cache.backend}",
                "per admitted prompt batch",
                1,
                lambda: engine.lower_prefill(bucket),
                arguments,
                dims={"rows": engine.prefill_rows, "seq_len": bucket},
            )
        )
    if "decode" in names:
        steps = engine.decode_steps_per_call
        # The engine compiles a decode step per bucket and runs the smallest that holds the
        # live sequences; only the largest (every slot) is compiled here.
        buckets = ", ".join(str(rows) for rows in inference.decode_rows)
        out.append(
            Program(
                "decode",
                "inference",
                f"{engine.num_slots} slots (largest of the decode buckets {buckets}) × "
                f"{steps} token(s) of up to {engine.max_seq_len}, attention {cache.backend}",
                f"per {steps} token(s) of every slot",
                1,
                engine.lower_decode,
                arguments,
                dims={"slots": engine.num_slots, "steps": steps, "max_seq_len": engine.max_seq_len},
            )
        )
    return out
