#!/usr/bin/env python3
"""Our GRPO update against Tunix's on the same model, batch and objective: time, compiled
FLOPs and the work in each program.

    .venv-peer/bin/python tools/profile_update.py [--size 20m|demo] [--steps N] [--json OUT]

(`.venv-peer` is built by tools/peer_env.py: Tunix cannot share our environment.)

Both sides update the same weights (configs/tiny_cpu.py's model at the size of
tools/bench_e2e.py, random from the run seed) on the same global batch: 64 rows of a 60-token
prompt and 4 response tokens (64 tokens, bench_e2e's lengths), group size 8, on-policy
(π_old = π_θ, β = 0: the demo's GRPO), Adam with clipping by global norm.

* ours: `Trainer.train_step` as a run's trainer calls it (its `time/step_s` is the jitted
  `rl_step`; `behaviour_logprobs=cached`, as the demo), the program `programs.rl_step`;
* Tunix: `tunix.sft.peft_trainer.PeftTrainer._train_step` with `grpo_loss_fn` (what
  `GRPOLearner` installs), our model behind Tunix's interface (tools/bench_e2e.py's adapter),
  jitted the way the PeftTrainer jits it.

Per program: median wall time of N steps after a compile step (the two interleaved, ours
then Tunix's; the ratio is the median of the per-pair ratios), XLA's cost analysis of the
compiled program (FLOPs, transcendentals, bytes accessed), and its op counts (dots and their
FLOPs, fusions, while loops, all-reduces, copies and transposes), which name where the two
do different work. Printed as one table with the ratio ours / Tunix.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_e2e import bench_config  # noqa: E402

from rlax_tpu.runtime import configure_jax  # noqa: E402

PROMPT, RESPONSE = 60, 4


def _config(size: str, overrides: list[str]):
    config = bench_config(size, quick=False, workers=1, extra=[])
    return config.apply_overrides(["trainer.behaviour_logprobs=cached", *overrides])


def hlo_profile(compiled) -> dict:
    """XLA's cost analysis of a compiled program and counts of its ops by kind."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    ops = Counter(op for line in text.splitlines() if (op := _opcode(line)))
    return {
        "flops": float(cost.get("flops", 0.0)),
        "transcendentals": float(cost.get("transcendentals", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "ops": dict(sorted(ops.items())),
        "instructions": sum(ops.values()),
    }


def _opcode(line: str) -> str | None:
    """The opcode of an HLO instruction line (`%x = SHAPE opcode(...)`, SHAPE possibly a
    tuple `(f32[], ...)`), None for other lines."""
    head, eq, rest = line.partition(" = ")
    if not eq or not head.strip().removeprefix("ROOT ").startswith("%"):
        return None
    rest = rest.lstrip()
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, c in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][a-z0-9-]*)\(", rest)
    return m.group(1) if m else None


def batch_arrays(config, seed: int = 0):
    """The shared batch: tokens int32[64, 64] (prompt then response; a group's 8 rows share
    their prompt, as a GRPO batch's samples do), per-row rewards, and the advantages GRPO
    derives from them (per group of 8: (r − mean) / (std + 1e-4))."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = config.controller.global_batch_size
    group = config.controller.samples_per_prompt
    tokens = rng.integers(3, config.model.vocab_size, (rows, PROMPT + RESPONSE)).astype(np.int32)
    tokens[:, :PROMPT] = np.repeat(tokens[::group, :PROMPT], group, axis=0)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    r = rewards.reshape(-1, group)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1)
    return tokens, rewards, adv.astype(np.float32)


def token_passes(trainer, tokens, mask) -> dict:
    """Token slots one update runs through the model, forward and backward: the padded
    batch's rows once each way; packed rows (trainer.tokens_per_row) only the used packed
    micro-batches', forward twice when a mini-batch spans several micro-batches (pass 1
    without gradient, pass 2 with). XLA's cost analysis counts a scan's body once, so for
    a packed program these, not its FLOPs, say the work run."""
    programs, levels = trainer.programs, trainer.programs.levels
    if not programs.tokens_per_row:
        return {"forward_tokens": tokens.size, "backward_tokens": tokens.size}
    layout = programs.layout(mask, chunks=levels.num_updates, tokens=tokens)
    slots = layout.packed_tokens
    twice = levels.micro_per_mini > 1
    return {"forward_tokens": slots * (2 if twice else 1), "backward_tokens": slots}


def ours(config) -> tuple:
    import jax.numpy as jnp
    import numpy as np

    from rlax_tpu.algorithms import RolloutBatch
    from rlax_tpu.trainer import Trainer

    tokens, rewards, _ = batch_arrays(config)
    rows, seq = tokens.shape
    mask = np.zeros((rows, seq), bool)
    mask[:, PROMPT - 1 : seq - 1] = True  # targets tokens[PROMPT:]: the response

    def batch(step: int) -> RolloutBatch:
        return RolloutBatch(
            tokens=jnp.asarray(tokens),
            response_mask=jnp.asarray(mask),
            group_ids=jnp.asarray(np.arange(rows) // config.controller.samples_per_prompt),
            rewards=jnp.asarray(rewards),
            behaviour_logprobs=jnp.zeros((rows, seq), jnp.float32),
            versions=jnp.full((rows,), step, jnp.int32),
        )

    run_dir = tempfile.mkdtemp(prefix="profile-update-")
    config = config.apply_overrides([f"storage.run_dir={run_dir}", "trainer.warm_start.steps=0"])
    trainer = Trainer(config)
    trainer.initialize()
    trainer.train_step(0, batch(0))  # compiles
    programs = trainer.programs
    compiled = programs.rl_step.lower(*programs.abstract_rl_step_args(seq)).compile()
    count = iter(range(1, 10**9))

    def step() -> float:
        """One update as a run's trainer takes it; the jitted rl_step's seconds."""
        return trainer.train_step(s := next(count), batch(s)).metrics["time/step_s"]

    def close() -> None:
        trainer.close()
        shutil.rmtree(run_dir, ignore_errors=True)

    profile = hlo_profile(compiled) | token_passes(trainer, tokens, mask)
    return step, close, profile


def tunix(config) -> tuple:
    import jax
    import numpy as np
    import optax
    from bench_e2e import tunix_model
    from flax import nnx
    from tunix.rl import common as tunix_common
    from tunix.rl.algo_core import grpo_loss_fn
    from tunix.rl.grpo.grpo_learner import GRPOConfig
    from tunix.sft import peft_trainer

    from rlax_tpu.models import Transformer

    tr = config.trainer.optimizer
    model = tunix_model(Transformer(config.model, rngs=nnx.Rngs(config.seed)))
    # Data parallel over the same devices as our trainer's mesh (data = all devices, the
    # demo's layout): weights (and so Adam's moments) replicated, the batch split by rows.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    nnx.update(model, jax.device_put(nnx.state(model), replicated))
    optimizer = optax.chain(
        optax.clip_by_global_norm(tr.grad_clip_norm),
        optax.adam(tr.learning_rate, b1=tr.adam_b1, b2=tr.adam_b2, eps=tr.adam_eps),
    )
    trainer = peft_trainer.PeftTrainer(
        model, optimizer, peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    )
    algo = GRPOConfig(num_generations=config.controller.samples_per_prompt, beta=0.0)
    algo.temperature = config.inference.temperature  # as GRPOLearner sets it from its rollouts
    trainer.with_loss_fn(
        lambda model, train_example, algo_config: grpo_loss_fn(
            model, train_example, algo_config=algo, pad_id=0, eos_id=1
        ),
        has_aux=True,
    )
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    tokens, _, adv = batch_arrays(config)
    rows = tokens.shape[0]
    example = tunix_common.TrainExample(
        prompt_ids=jax.device_put(tokens[:, :PROMPT], by_rows),
        prompt_mask=jax.device_put(np.ones((rows, PROMPT), np.int32), by_rows),
        completion_ids=jax.device_put(tokens[:, PROMPT:], by_rows),
        completion_mask=jax.device_put(np.ones((rows, RESPONSE), np.int32), by_rows),
        advantages=jax.device_put(adv, by_rows),
        ref_per_token_logps=None,
        old_per_token_logps=None,
    )
    train_step, _ = trainer.jit_train_and_eval_step()
    jax.block_until_ready(train_step(example))  # compiles

    def step() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(train_step(example))
        return time.perf_counter() - t0

    # The same body under jax.jit, for the compiled program's figures.
    graphdef, state = nnx.split((trainer.model, trainer.optimizer))

    def body(state, example):
        m, o = nnx.merge(graphdef, state)
        out = trainer._train_step(m, o, example)
        return out, nnx.state((m, o))

    compiled = jax.jit(body).lower(state, example).compile()
    tokens_run = {"forward_tokens": tokens.size, "backward_tokens": tokens.size}
    return step, lambda: None, hlo_profile(compiled) | tokens_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("demo", "20m"), default="20m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of our side (e.g. trainer.mesh.data=1 trainer.mesh.fsdp=2)",
    )
    parser.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="overrides (on top of --set) of a second of our updates, 'ours after', timed "
        "in the same rounds (e.g. trainer.tokens_per_row=128 trainer.share_prefixes=true "
        "trainer.micro_batch_size=8)",
    )
    args = parser.parse_args()
    config = _config(args.size, args.set)
    configure_jax(config)
    from rlax_tpu.hardware import host_cpu

    result = {"size": args.size, "host": host_cpu(), "steps": args.steps, "after_set": args.after}
    sides = {"ours": ours(config)}
    if args.after:
        sides["ours_after"] = ours(config.apply_overrides(args.after))
    sides["tunix"] = tunix(config)
    # Interleaved (ours, [ours after,] Tunix, ours, ...) so that a noisy host slows all alike.
    times = [{name: side[0]() for name, side in sides.items()} for _ in range(args.steps)]
    for name, (_, close, profile) in sides.items():
        close()
        result[name] = profile
        profile["step_s_all"] = [round(t[name], 4) for t in times]
        profile["step_s"] = statistics.median(t[name] for t in times)
        profile["step_ratio"] = statistics.median(t[name] / t["tunix"] for t in times)
    names = list(sides)
    print(f"GRPO update, {args.size} model, 64x64 tokens, {result['host']}, median of {args.steps}")
    if args.after:
        print(f"ours after: {' '.join(args.after)}")
    print(
        f"{'':<20}"
        + "".join(f"{n:>14}" for n in names)
        + "".join(f"{n + '/Tunix':>18}" for n in names[:-1])
    )
    rows = [("step s", "step_s"), ("tokens forward", "forward_tokens")]
    rows += [("tokens backward", "backward_tokens"), ("GFLOPs (XLA)", "flops")]
    rows += [("transcendentals M", "transcendentals"), ("MB accessed", "bytes_accessed")]
    rows += [("instructions", "instructions")]
    scale = {"flops": 1e9, "transcendentals": 1e6, "bytes_accessed": 1e6}
    t = result["tunix"]
    for label, key in rows:
        values = [result[n][key] / scale.get(key, 1) for n in names]
        ratios = [
            result[n]["step_ratio"]
            if key == "step_s"
            else result[n][key] / t[key]
            if t[key]
            else float("nan")
            for n in names[:-1]
        ]
        print(
            f"{label:<20}"
            + "".join(f"{v:>14.3f}" for v in values)
            + "".join(f"{r:>18.2f}" for r in ratios)
        )
    print("ops whose counts differ between ours and Tunix's (the rest are equal):")
    o = result["ours"]
    for op in sorted(set(o["ops"]) | set(t["ops"])):
        a, b = o["ops"].get(op, 0), t["ops"].get(op, 0)
        if a != b:
            print(f"  {op:<16}{a:>14}{b:>14}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
