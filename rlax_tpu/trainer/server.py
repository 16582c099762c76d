"""The trainer process behind `rlax-tpu serve trainer`.

Builds the Trainer on the config's trainer mesh, connects it to the parameter server
(--param-server, replicas in order), restores its newest checkpoint or starts at version 0
(`initialize`), serves Trainer and Health on one gRPC server bound to loopback unless told
otherwise, prints `READY host:port` on stdout once serving, and on SIGTERM or SIGINT lets a
running step finish, saves a checkpoint (waiting for it) and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rlax_tpu.config import RunConfig
from rlax_tpu.rpc import format_address
from rlax_tpu.rpc.process import announce_ready, component_config, stop_on_signals, wait_for

DEFAULT_INSTANCE_ID = "trainer-0"
# Calls that change the trainer run one at a time; a few more threads keep Health and
# waiting retries answerable while a step trains.
_MAX_WORKERS = 8


def _replica_plan(config: RunConfig, num_replicas: int) -> Any:
    """Split each parameter across replicas along its tensor-parallel dimension, as the
    params are sharded, so a tensor-parallel worker pulls each slice from one replica."""
    from rlax_tpu.param_server.client import replica_plan_for_model

    return replica_plan_for_model(
        config.model, config.trainer.mesh.logical_axis_rules, num_replicas
    )


def main(args: argparse.Namespace) -> int:
    """`rlax-tpu serve trainer`: serve until SIGTERM or SIGINT, save, then exit 0."""
    resolved = component_config(args, "trainer")
    if resolved is None:
        return 2
    config, token = resolved

    from rlax_tpu.param_server.client import ParamServerClient
    from rlax_tpu.rpc import HealthServicer, make_server
    from rlax_tpu.sharding import build_mesh
    from rlax_tpu.trainer import Trainer
    from rlax_tpu.trainer.service import TrainerServicer, trainer_status

    host = args.host or "127.0.0.1"
    stop = stop_on_signals()
    param_server = None
    if args.param_server:
        plan = _replica_plan(config, len(args.param_server)) if len(args.param_server) > 1 else None
        param_server = ParamServerClient(args.param_server, auth_token=token, plan=plan)
    try:
        server, port = make_server(
            host,
            args.port,
            auth_token=token,
            auth_token_env=config.param_server.auth_token_env,
            max_workers=_MAX_WORKERS,
        )
    except OSError as e:  # the port is taken
        print(f"rlax-tpu serve trainer: {e}", file=sys.stderr)
        return 2
    mesh = build_mesh(config.trainer.mesh)
    trainer = Trainer(config, param_server=param_server, mesh=mesh)
    step = trainer.initialize()
    servicer = TrainerServicer(trainer, vocab_size=config.model.vocab_size)
    servicer.add_to_server(server)
    digest = config.digest()
    HealthServicer(
        lambda: trainer_status(trainer, instance_id=DEFAULT_INSTANCE_ID, config_digest=digest)
    ).add_to_server(server)
    server.start()
    address = format_address(host, port)
    announce_ready(
        address,
        f"trainer: {config.model.architecture} on mesh {dict(mesh.shape)} at step "
        f"{step}, run dir {config.storage.run_dir}, parameter server "
        f"{','.join(args.param_server) or '(none)'}, listening on {address}",
    )
    wait_for(stop)
    server.stop(5.0).wait()
    with servicer.lock:  # a step still running in a handler thread finishes first
        saved = trainer.save(wait=True)
        trainer.close()
    print(f"trainer: saved step {saved}; stopped", file=sys.stderr, flush=True)
    if param_server is not None:
        param_server.close()
    return 0
