#!/usr/bin/env python3
"""A co-located worker's placement of the trainer's arrays, against jax.device_put.

    python tools/bench_colocated_load.py [--size demo|20m] [--rounds 60] [--set K=V] [--json OUT]

In one process, on the bench config's devices (tools/bench_e2e.py's, inference.colocated):
initialise the trainer, take the arrays it hands a co-located worker (its published
params, on the trainer's mesh), and time, interleaved round by round,

* `place_ms`: `ServedWeights.place` of them onto the worker's mesh, as a co-located load
  does (replicated leaves sliced by one jitted identity, sharded ones moved by one
  device_put, the rest relabelled; `--set trainer.mesh.data=1 --set trainer.mesh.fsdp=2`
  for an FSDP trainer's), and
* `device_put_ms`: `jax.device_put` of the same cast arrays to the same shardings (the
  baseline: what place did before),

each until the results are ready; medians and the ratio `device_put_ms / place_ms`. The
two results are checked bitwise equal. Run it on an idle host: the figures are a few ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("demo", "20m"), default="demo")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="a config override"
    )
    args = parser.parse_args()

    from bench_e2e import bench_config

    from rlax_tpu.runtime import configure_jax

    config = bench_config(args.size, False, 1, ["inference.colocated=true", *args.overrides])
    configure_jax(config)  # the config's virtual CPU devices, as a component starts

    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlax_tpu.inference.weights import ServedWeights
    from rlax_tpu.sharding import build_mesh
    from rlax_tpu.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        config = config.apply_overrides([f"storage.run_dir={tmp}"])
        trainer = Trainer(config, param_server=None)
        trainer.initialize()
        handed = trainer._published_params()  # what Trainer._publish hands the worker
        weights = ServedWeights(config.model, config.inference, build_mesh(config.inference.mesh))
        shardings = [leaf.sharding for leaf in weights._layout]

        def inputs() -> list:
            """The handed leaves in the worker's order, cast to the served dtypes."""
            out = []
            for leaf in weights._layout:
                node = handed
                for key in leaf.keys:
                    node = node[key] if key in node else node[str(key)]
                out.append(jnp.asarray(node, leaf.dtype))
            return out

        def previous() -> list:
            """What place did before: each leaf looked up and cast, then one device_put."""
            return jax.device_put(inputs(), shardings)

        def place() -> float:
            t = time.perf_counter()
            jax.block_until_ready(weights.place(handed))
            return time.perf_counter() - t

        def device_put() -> float:
            t = time.perf_counter()
            jax.block_until_ready(previous())
            return time.perf_counter() - t

        for _ in range(3):  # compiles and first touches
            place(), device_put()
        timings: dict[str, list[float]] = {"place": [], "device_put": []}
        for _ in range(args.rounds):
            timings["place"].append(place())
            timings["device_put"].append(device_put())
        same = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(weights.place(handed), previous(), strict=True)
        )
        trainer.close()
        cast = inputs()
        moved = sum(
            not x.sharding.is_equivalent_to(sh, x.ndim)
            for x, sh in zip(cast, shardings, strict=True)
        )

    result = {
        "size": args.size,
        "leaves": len(cast),
        "moved_leaves": moved,
        "bytes": int(sum(x.nbytes for x in cast)),
        "trainer_mesh": dict(trainer.mesh.shape),
        "worker_mesh": dict(weights._mesh.shape) if weights._mesh is not None else None,
        "rounds": args.rounds,
        "place_ms": round(1000 * statistics.median(timings["place"]), 3),
        "device_put_ms": round(1000 * statistics.median(timings["device_put"]), 3),
        "bitwise_equal": same,
    }
    result["device_put_vs_place"] = round(result["device_put_ms"] / result["place_ms"], 2)
    print(
        f"{args.size}: {result['leaves']} leaves ({result['moved_leaves']} resharded), "
        f"{result['bytes'] / 1e6:.1f} MB, trainer mesh {result['trainer_mesh']} -> worker "
        f"mesh {result['worker_mesh']}, {args.rounds} interleaved rounds"
    )
    print(f"| {'':24s} | {'median ms':>9s} | {'ratio':>5s} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 7}|")
    print(f"| {'place (co-located load)':24s} | {result['place_ms']:9.2f} | {1:5.2f} |")
    print(
        f"| {'before: jax.device_put':24s} | {result['device_put_ms']:9.2f} | "
        f"{result['device_put_vs_place']:5.2f} |"
    )
    print(f"bitwise equal: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
