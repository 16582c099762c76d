"""Every jitted program a run executes on its accelerators, ready to lower on abstract inputs.

The trainer's come from `TrainerPrograms` (the builder `Trainer` itself uses), the inference
worker's from an `Engine` built without device memory (`allocate=False`), so the programs
compiled here are the ones the run executes, at the shapes it executes them:

  trainer    init        version 0's params: the random init program, or with
                         model.hf_checkpoint the sharded load (no program: each device
                         receives its shards, one at a time; sized from the shardings)
             init_opt    the optimizer state from the params (the SFT warm start's, or RL's),
                         with the reference copy the trainer then keeps beside them
             rl_step     one train step's update of the global batch (prompts_per_batch ×
                         samples_per_prompt rows of trainer.max_seq_len tokens; with
                         trainer.tokens_per_row, packed in rows of that many, sized for
                         every packed micro-batch used)
             recompute   π_old (and V_old) of the global batch, micro-batch by micro-batch;
                         run again on the reference params when the objective has a KL term
             sft_step    one SFT warm-start step (only when trainer.warm_start.steps > 0)
             publish     the params cast to model.publish_dtype (and unstacked) for the
                         parameter server (only when they are not served as they are held)
  inference  prefill     inference.prefill_rows prompts, at every prefill bucket
             extend      inference.prefill_rows continuations fed after their cached pages
                         (an episode's next turn: controller.environment; a "keep"
                         continuation), at every prefill bucket, only where the run has them
             decode      one decode call, at every decode bucket (inference.decode_rows)
             swap_out    the copy of a whole sequence's pages out of the KV pool (before the
                         device-to-host transfer of a swap-out)
             swap_in     the write of a swapped sequence's pages back into the pool

Each program also counts what its component holds beside it while it runs (`resident`: the
optimizer state during a publish, the reference copy during a train step, the served
weights during a swap), so a program's total is what the chip holds at its peak.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax

from rlax_tpu.config import RunConfig
from rlax_tpu.sharding import use_mesh

COMPONENT_OF = {
    "init": "trainer",
    "init_opt": "trainer",
    "rl_step": "trainer",
    "recompute": "trainer",
    "sft_step": "trainer",
    "publish": "trainer",
    "prefill": "inference",
    "extend": "inference",
    "decode": "inference",
    "swap_out": "inference",
    "swap_in": "inference",
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
    # None: no compiled program (the sharded checkpoint load); its memory is `resident`.
    lower: Callable[[], jax.stages.Lowered] | None
    arguments: dict[str, int]
    gradients: int = 0
    # Per chip, what the component holds beside the program while it runs, by kind.
    resident: dict[str, int] = dataclasses.field(default_factory=dict)
    # The shape as numbers: rows, seq_len (tokens per row), micro_batch, updates (trainer);
    # rows, seq_len (prefill); slots, steps, max_seq_len (decode).
    dims: dict[str, int] = dataclasses.field(default_factory=dict)
    # What `--save-compiled` saves it as, and the run looks it up by: the name, with the
    # bucket of a program compiled at several ("prefill@128"; Engine.lowerings).
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or self.name


def per_chip_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def lora_savings(config: RunConfig, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """What LoRA (model.lora) saves the trainer, per chip of `mesh`: the parameters it trains,
    and the bytes of its optimizer state, gradients and reference copy against full
    fine-tuning of the same model (abstract layouts: nothing is compiled or allocated)."""
    from rlax_tpu.trainer.programs import TrainerPrograms

    full_config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora=None))
    lora, full = TrainerPrograms(config, mesh), TrainerPrograms(full_config, mesh)
    reference = lora.objective.needs_reference_logprobs

    def held(tp: TrainerPrograms) -> dict[str, int]:
        trained = per_chip_bytes(tp.abstract_trainable)
        return {
            "params": per_chip_bytes(tp.abstract_params),
            "optimizer_state": per_chip_bytes(tp.rl.abstract),
            "gradients": trained,
            "reference": trained if reference else 0,
        }

    with_lora, without = held(lora), held(full)
    return {
        "rank": config.model.lora.rank,
        "targets": list(config.model.lora.targets),
        "trained_params": lora.num_trainable,
        "total_params": lora.num_params,
        "bytes_per_chip": with_lora,
        "full_fine_tuning_bytes_per_chip": without,
        "saved_bytes_per_chip": sum(without.values()) - sum(with_lora.values()),
    }


def trainer_programs(config: RunConfig, mesh: jax.sharding.Mesh, names: set[str]) -> list[Program]:
    from rlax_tpu.trainer.programs import TrainerPrograms

    tp = TrainerPrograms(config, mesh)
    levels, seq = tp.levels, config.trainer.max_seq_len
    params = per_chip_bytes(tp.abstract_params)
    rl_opt = per_chip_bytes(tp.rl.abstract)
    # What RL trains (with LoRA the adapters alone: gradients, optimizer state and the
    # reference copy are theirs) and what the warm start's SFT trains (the base).
    trained = per_chip_bytes(tp.abstract_trainable)
    sft_trained = per_chip_bytes(tp.sft.split(tp.abstract_params)[0])
    # The reference copy (π_ref) the trainer keeps beside the params in RL, when the
    # objective reads reference log-probs.
    reference_copy = {"reference": trained} if tp.objective.needs_reference_logprobs else {}
    batch = (
        f"{levels.global_size} × {seq} tokens: {levels.num_updates} update(s) of "
        f"{levels.mini_size}, micro-batch {levels.micro_size}"
    )
    rows_of = f"{levels.global_size} × {seq} tokens"
    # Packed batches (trainer.tokens_per_row): each micro-batch is micro rows of that many
    # tokens, and the programs are sized, and their FLOPs counted, for the worst case: every
    # packed micro-batch used (a skipped one costs nothing at run time).
    packed = config.trainer.tokens_per_row
    if packed:
        rows_of = f"{levels.global_size} × {seq} tokens packed in rows of {packed}"
        batch = (
            f"{rows_of}: {levels.num_updates} update(s) of {levels.mini_size}, "
            f"micro-batch {levels.micro_size} × {packed} tokens"
        )

    # The trainer's own table of what it runs at which abstract arguments (the same that
    # `trainer.compiled_dir` loads saved executables against).
    table = tp.lowerings()

    def lowering(name: str) -> Callable[[], jax.stages.Lowered]:
        fn, args, _ = table[name]

        def lower() -> jax.stages.Lowered:
            with use_mesh(mesh, tp.rules):
                return fn.lower(*args)

        return lower

    dims = {
        "rows": levels.global_size,
        "seq_len": packed or seq,  # tokens per row of the micro-batches
        "micro_batch": levels.micro_size,
        "updates": levels.num_updates,
    }
    out = []
    if "init" in names:
        if config.model.hf_checkpoint:
            # Each device receives its shards of one tensor at a time (models.hf): at most the
            # params and the largest shard in flight.
            largest = max(per_chip_bytes(x) for x in jax.tree.leaves(tp.abstract_params))
            out.append(
                Program(
                    "init",
                    "trainer",
                    f"load {config.model.hf_checkpoint} into the params' shardings",
                    "once, at start-up",
                    1,
                    None,
                    {},
                    resident={"params": params, "inputs": largest},
                )
            )
        else:
            out.append(
                Program(
                    "init",
                    "trainer",
                    f"random init of {tp.num_params:,} parameters",
                    "once, at start-up",
                    1,
                    lowering("init"),
                    {},
                )
            )
    if "init_opt" in names:
        # RL's optimizer (the warm start's, when there is one, is the same optimizer at
        # another learning rate: the same size); then the reference copy.
        out.append(
            Program(
                "init_opt",
                "trainer",
                "optimizer state from the params"
                + (", then the reference copy" if reference_copy else ""),
                "once, at start-up (and when RL starts after the warm start)",
                1,
                lowering("init_opt"),
                {"params": params},
                resident=reference_copy,
            )
        )
    if "rl_step" in names:
        out.append(
            Program(
                "rl_step",
                "trainer",
                batch,
                "once per train step",
                1,
                lowering("rl_step"),
                {"params": params, "optimizer_state": rl_opt},
                gradients=trained,
                resident=reference_copy,
                dims=dims,
            )
        )
    if "recompute" in names:
        reference = tp.objective.needs_reference_logprobs
        out.append(
            Program(
                "recompute",
                "trainer",
                f"{rows_of}, micro-batch {levels.micro_size}",
                "twice per train step (π_old, reference)" if reference else "once per train step",
                2 if reference else 1,
                lowering("recompute"),
                {"params": params},
                # The second call's params are the reference, the first's are the params.
                resident={"optimizer_state": rl_opt, **reference_copy},
                dims=dims,
            )
        )
    if "sft_step" in names and config.trainer.warm_start.steps > 0:
        out.append(
            Program(
                "sft_step",
                "trainer",
                batch,
                f"once per SFT warm-start step ({config.trainer.warm_start.steps})",
                1,
                lowering("sft_step"),
                {"params": params, "optimizer_state": per_chip_bytes(tp.sft.abstract)},
                gradients=sft_trained,
                dims=dims,
            )
        )
    if "publish" in names and tp.publish is not None:
        out.append(
            Program(
                "publish",
                "trainer",
                ("LoRA adapters" if tp.lora else "params")
                + f" to {config.model.published_dtype}"
                + (", per layer" if config.trainer.scan_layers else ""),
                "once per published version",
                1,
                lowering("publish"),
                {"params": params},
                resident={"optimizer_state": rl_opt, **reference_copy},
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
    # The attention kernel, and the projections' dtype when served quantized.
    serving = f"attention {cache.backend}"
    if inference.weight_dtype:
        serving += f", {inference.weight_dtype} projections"
    out = []
    # Calls that feed tokens at the prefill buckets (continuation buckets too, when used):
    # prompts, and with episodes or "keep" continuations fed after their cached pages.
    fed = [("prefill", engine.lower_prefill, "tokens", "per admitted prompt batch")]
    if config.controller.environment.enabled or inference.in_flight_update == "keep":
        fed.append(
            (
                "extend",
                engine.lower_extend,
                "tokens after cached pages",
                "per admitted batch of continuations",
            )
        )
    for name, lower, tokens, calls in fed:
        if name not in names:
            continue
        for bucket in engine.prefill_buckets:
            out.append(
                Program(
                    name,
                    "inference",
                    f"{engine.prefill_rows} × {bucket} {tokens}, {cache.num_pages} pages of "
                    f"{cache.page_size}, {serving}",
                    f"{calls} of bucket {bucket}",
                    1,
                    functools.partial(lower, bucket),
                    arguments,
                    dims={"rows": engine.prefill_rows, "seq_len": bucket},
                    key=f"{name}@{bucket}",
                )
            )
    if "decode" in names:
        steps = engine.decode_steps_per_call
        # The engine runs the smallest bucket that holds the live sequences.
        for rows in inference.decode_rows:
            out.append(
                Program(
                    "decode",
                    "inference",
                    f"{rows} of {engine.num_slots} slots × {steps} token(s) of up to "
                    f"{engine.max_seq_len}, {serving}",
                    f"per {steps} token(s) of up to {rows} live slots",
                    1,
                    functools.partial(engine.lower_decode, rows),
                    arguments,
                    dims={"slots": rows, "steps": steps, "max_seq_len": engine.max_seq_len},
                    key=f"decode@{rows}",
                )
            )
    pages = engine.swap_pages
    swaps = {
        "swap_out": (engine.lower_swap_out, "per sequence swapped out (pool full)"),
        "swap_in": (engine.lower_swap_in, "per sequence swapped back in"),
    }
    for name, (lower, calls) in swaps.items():
        if name in names:
            out.append(
                Program(
                    name,
                    "inference",
                    f"{pages} pages of {cache.page_size} tokens (a whole sequence's)",
                    calls,
                    1,
                    functools.partial(lower, pages),
                    {"kv_cache": arguments["kv_cache"]},
                    resident={"params": arguments["params"]},
                    dims={"pages": pages},
                    key=f"{name}@{pages}",
                )
            )
    return out
