"""One process of the multi-host trainer in test_multihost.py.

Run as `python tests/multihost_worker.py --param-server ADDR --run-dir DIR --out FILE` with
the RLAX_TPU_* distributed variables, XLA_FLAGS (virtual CPU devices) and the auth token
in the environment. It joins the job, trains `--steps` steps of the shared tiny config on
the same batches in every process (the trainer mesh spans all processes), publishes each
version, pulls the newest one back into the trainer's sharding, checkpoints, and writes
what it saw as JSON to FILE.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def config_for(run_dir: str, *, data: int, fsdp: int, tensor: int):
    """The run config of every process (and of the single-process reference): the tiny
    trainer config of trainer_helpers with one layer (less to compile on 2 cores) and, as in
    test_trainer.py, an adam_eps well above the gradient noise of another reduction order."""
    from trainer_helpers import run_config

    from rlax_tpu.config import MeshConfig

    mesh = MeshConfig(data=data, fsdp=fsdp, tensor=tensor)
    config = run_config(run_dir, adam_eps=1e-4, mini=4, mesh=mesh)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=1))


def main() -> int:
    if sys.platform.startswith("linux"):  # die with the test process, as tests/processes.py
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    parser = argparse.ArgumentParser()
    parser.add_argument("--param-server", action="append", required=True)
    parser.add_argument("--mesh", default="2,2,2", help="data,fsdp,tensor")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    from rlax_tpu.distributed import initialize_from_environment

    start = time.perf_counter()
    env = initialize_from_environment()  # before anything touches a device

    import jax
    import numpy as np
    from trainer_helpers import rollout_batch

    from rlax_tpu.param_server.trees import TreeClient
    from rlax_tpu.trainer import Trainer
    from rlax_tpu.trainer.server import replica_plan_for_model

    data, fsdp, tensor = (int(n) for n in args.mesh.split(","))
    config = config_for(args.run_dir, data=data, fsdp=fsdp, tensor=tensor)
    rules = config.trainer.mesh.logical_axis_rules
    client = TreeClient(
        args.param_server,
        auth_token=os.environ[config.param_server.auth_token_env],
        plan=replica_plan_for_model(config.model, rules, len(args.param_server)),
    )
    timings = {"distributed_init_s": time.perf_counter() - start}
    trainer = Trainer(config, param_server=client)
    trainer.initialize()
    timings["initialize_s"] = time.perf_counter() - start
    results = []
    for step in range(args.steps):
        batch = jax.tree.map(np.asarray, rollout_batch(step))  # the same host batch everywhere
        results.append(trainer.train_step(step, batch))
        timings[f"step_{step}_s"] = time.perf_counter() - start

    params = trainer.params()
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    pulled = client.pull(args.steps, like)
    pulled_equal = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(pulled), strict=True)
        for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True)
    )
    timings["pull_s"] = time.perf_counter() - start
    spans = sorted({d.process_index for d in trainer.mesh.devices.flat})
    trainer.save(wait=True)
    trainer.close()
    timings["save_s"] = time.perf_counter() - start
    client.close()
    out = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "env": env.describe(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
        "mesh_shape": dict(trainer.mesh.shape),
        "mesh_processes": spans,
        "metrics": [r.metrics for r in results],
        "versions": [r.version for r in results],
        "pulled_equal": pulled_equal,
        "bytes_pulled": client.bytes_pulled,
        "timings": timings,
    }
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
