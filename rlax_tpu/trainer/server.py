"""The trainer process behind `rlax-tpu serve trainer`.

Builds the Trainer on the config's trainer mesh, connects it to the parameter server
(--param-server, replicas in order), restores its newest checkpoint or starts at version 0
(`initialize`), serves Trainer and Health on one gRPC server bound to loopback unless told
otherwise, prints `READY host:port` on stdout once serving (and before and after it, its slow
phases as `PROGRESS` lines: checkpoint restores, first compiles), and on SIGTERM or SIGINT
lets a running step finish, saves a checkpoint (waiting for it) and exits 0.

Multi-host (rlax_tpu.distributed: one process per host, the mesh over every host's
devices): process 0 is the leader, the only one that serves gRPC. Each call that changes the
trainer is broadcast to the other processes (followers) before the leader runs it, so every
process runs the same steps on the same batch in the same order; at shutdown the leader has
them save with it, then tells them to stop.

Co-located (`inference.colocated`): the process also builds the run's one inference worker
on the same devices and serves it on a second gRPC server (announced as `ALSO
inference_worker-0 host:port` before READY); the trainer hands it each version it publishes
(rlax_tpu.colocation) and sends it to the parameter server in the background, or, with
inference.colocated_publish "needed", only when a snapshot may rely on it. A step call that
asks for it (load_colocated) has the worker queue its load of the new version before the
reply.
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax

from rlax_tpu.api.param_server import ReplicaPlan, split_dims_from_logical
from rlax_tpu.api.trainer import SFT_STEP, TRAIN_STEP, BatchLimits, pack_batch, unpack_batch
from rlax_tpu.colocation import DEFAULT_KEEP, SharedVersions
from rlax_tpu.config import ModelConfig, RunConfig
from rlax_tpu.distributed import broadcast_bytes
from rlax_tpu.inference.server import DEFAULT_WORKER_ID, serve_worker
from rlax_tpu.models.transformer import param_logical_axes
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.rpc import HealthServicer, format_address
from rlax_tpu.rpc.process import (
    announce_also,
    announce_progress,
    announce_ready,
    bind_server,
    component_config,
    join_distributed_job,
    stop_on_signals,
    wait_for,
)
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import (
    BatchSizeError,
    NotInitializedError,
    NoValidCheckpointError,
    OutOfOrderStepError,
    StaleRolloutError,
    Trainer,
)
from rlax_tpu.trainer.service import TrainerServicer, batch_from_arrays, trainer_status

_log = logging.getLogger(__name__)

DEFAULT_INSTANCE_ID = "trainer-0"
# Calls that change the trainer run one at a time; a few more threads keep Health and
# waiting retries answerable while a step trains.
_MAX_WORKERS = 8


def replica_plan_for_model(
    model: ModelConfig, rules: Sequence[tuple[str, Sequence[str]]], num_replicas: int
) -> ReplicaPlan:
    """Split a model's parameters across parameter-server replicas along the dimension
    `rules` shard over the tensor axis, as the params are sharded, so a tensor-parallel
    worker pulls each slice from one replica. The trainer computes the plan (it knows the
    model); the parameter server and its JAX-free client only follow it."""
    split = split_dims_from_logical(param_logical_axes(model), rules)
    return ReplicaPlan(num_replicas=num_replicas, split_dims=split)


def connect_param_server(
    config: RunConfig, addresses: list[str], token: str, stop: threading.Event | None = None
) -> Any:
    """The trainer's ParamServerClient for the replicas at `addresses`: publishes in
    `param_server.chunk_bytes` chunks, split across replicas as the params are sharded. A
    server that does not answer is waited for (`controller.component_wait_s`) until `stop`
    is set: a stopping trainer saves its checkpoint rather than wait for it."""
    plan = (
        (
            replica_plan_for_model(
                config.model, config.trainer.mesh.logical_axis_rules, len(addresses)
            )
        )
        if len(addresses) > 1
        else None
    )
    return TreeClient(
        addresses,
        auth_token=token,
        plan=plan,
        chunk_bytes=config.param_server.chunk_bytes,
        reconnect_s=config.controller.component_wait_s,  # a restarted server is waited for
        on_retry=_log.warning,
        stop=stop,
    )


# -- multi-host: the leader broadcasts each call, followers run it --------------------------
def _encode(op: str, fields: dict[str, Any], payload: Sequence[bytes | memoryview] = ()) -> bytes:
    """One message: the command as JSON, then `payload`'s parts (joined once, no other copy)."""
    header = json.dumps({"op": op, **fields}).encode()
    return b"".join([struct.pack("<I", len(header)), header, *payload])


def _decode(message: bytes) -> tuple[dict[str, Any], memoryview]:
    (size,) = struct.unpack_from("<I", message)
    return json.loads(message[4 : 4 + size]), memoryview(message)[4 + size :]


class LeaderTrainer:
    """The Trainer as process 0's servicer sees it: every call that changes the trainer is
    first broadcast to the followers (`follow`), then run here. Calls arrive one at a time
    (the servicer's lock), so every process sees them in the same order."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def __getattr__(self, name: str) -> Any:  # step, status(), params(), ... are local reads
        return getattr(self._trainer, name)

    def _send(self, op: str, payload: Sequence[bytes | memoryview] = (), **fields: Any) -> None:

        broadcast_bytes(_encode(op, fields, payload))

    def train_step(self, step: int, batch: Any) -> Any:

        self._send("train_step", pack_batch(step, TRAIN_STEP.arrays_of(batch)), step=step)
        return self._trainer.train_step(step, batch)

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> Any:

        arrays = {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}
        self._send("sft_step", pack_batch(step, arrays), step=step)
        return self._trainer.sft_step(step, tokens, targets, loss_mask)

    def save(self, *, wait: bool = True) -> int:
        self._send("save", wait=wait)
        return self._trainer.save(wait=wait)

    def restore(self, step: int | None = None) -> int:
        self._send("restore", step=step)
        return self._trainer.restore(step)

    def republish(self, version: int) -> None:
        self._send("republish", version=version)
        self._trainer.republish(version)

    def stop_followers(self) -> None:
        self._send("stop")


def follow(trainer: Any) -> None:
    """A follower's life: run each call process 0 broadcasts until it says stop.

    A call refused before it trains (out of order, batch too big, no such checkpoint) is
    refused the same way on the leader, which reports it: the follower logs it and waits for
    the next. Any other failure ends the follower (the exception propagates): the leader would
    otherwise wait forever in a collective this process never joins, whereas JAX's
    coordination service takes the whole job down, to be restarted from its checkpoint.
    """

    refused = (
        BatchSizeError,
        NotInitializedError,
        NoValidCheckpointError,
        OutOfOrderStepError,
        StaleRolloutError,
    )
    while True:
        command, payload = _decode(broadcast_bytes(None))
        op = command["op"]
        try:
            if op == "stop":
                return
            if op == "train_step":
                step, arrays = unpack_batch(payload, TRAIN_STEP)
                del payload  # the batch lives on in `arrays` only
                trainer.train_step(step, batch_from_arrays(arrays))
            elif op == "sft_step":
                step, arrays = unpack_batch(payload, SFT_STEP)
                del payload
                trainer.sft_step(step, **arrays)
            elif op == "save":
                trainer.save(wait=command["wait"])
            elif op == "restore":
                trainer.restore(command["step"])
            elif op == "republish":
                trainer.republish(command["version"])
            else:
                raise ValueError(f"unknown command {op!r} from the leader")
        except refused as e:
            _log.warning("trainer follower: %s refused as on the leader: %s", op, e)
        except Exception:
            _log.exception("trainer follower: %s failed; stopping this process", op)
            raise


def main(args: argparse.Namespace) -> int:
    """`rlax-tpu serve trainer`: serve until SIGTERM or SIGINT, save, then exit 0."""
    resolved = component_config(args, "trainer")
    if resolved is None:
        return 2
    config, token = resolved
    distributed = join_distributed_job("trainer")  # before anything touches a device
    if distributed is None:
        return 2

    host = args.host or "127.0.0.1"
    stop = stop_on_signals()
    leader = jax.process_index() == 0
    colocated = config.inference.colocated
    if colocated and jax.process_count() > 1:
        print(
            f"rlax-tpu serve trainer: inference.colocated runs the inference worker inside "
            f"the trainer's process, on one host, but this trainer is {distributed.describe()}: "
            "set inference.colocated=false and run the workers as their own processes",
            file=sys.stderr,
        )
        return 2
    shared = None
    if colocated:
        shared = SharedVersions(DEFAULT_KEEP)
    param_server = None
    if args.param_server:  # every process sends its share of each version
        param_server = connect_param_server(config, args.param_server, token, stop)
    server = None
    if leader:
        bound = bind_server(
            "trainer",
            config,
            host,
            args.port,
            auth_token=token,
            max_workers=_MAX_WORKERS,
            max_receive_bytes=config.trainer.max_message_bytes,  # a batch comes in chunks
        )
        if bound is None:
            return 2
        server, port = bound
    mesh = build_mesh(config.trainer.mesh)
    trainer = Trainer(
        config, param_server=param_server, mesh=mesh, progress=announce_progress, shared=shared
    )
    step = trainer.initialize()
    if not leader:
        print(
            f"trainer: {distributed.describe()}, mesh {dict(mesh.shape)} at step {step}; "
            "following process 0",
            file=sys.stderr,
            flush=True,
        )
        follow(trainer)  # SIGTERM is the leader's to act on: it has us save, then stop
        trainer.close()
        print("trainer: the leader stopped; stopped", file=sys.stderr, flush=True)
        if param_server is not None:
            param_server.close()
        return 0
    served = LeaderTrainer(trainer) if jax.process_count() > 1 else trainer
    servicer = TrainerServicer(served, limits=BatchLimits.from_config(config))
    servicer.add_to_server(server)
    digest = config.digest()
    HealthServicer(
        lambda: trainer_status(trainer, instance_id=DEFAULT_INSTANCE_ID, config_digest=digest)
    ).add_to_server(server)
    server.start()
    address = format_address(host, port)
    colocated_worker = None
    if colocated:
        colocated_worker = serve_worker(
            config,
            token=token,
            host=host,
            port=0,
            worker_id=DEFAULT_WORKER_ID,
            param_server=args.param_server,
            stop=stop,
            shared=shared,
        )
        if colocated_worker is None:
            server.stop(0)
            trainer.close()
            if param_server is not None:
                param_server.close()
            return 2
        announce_also(DEFAULT_WORKER_ID, colocated_worker[3])
        # A step call may have the worker load the version it makes (TrainStep's
        # load_colocated): the controller then makes no Load call of its own.
        servicer.load_colocated = colocated_worker[1].load_handed
    processes = f", {distributed.describe()}" if distributed.is_multi_process else ""
    announce_ready(
        address,
        f"trainer: {config.model.architecture} on mesh {dict(mesh.shape)} at step "
        f"{step}, run dir {config.storage.run_dir}, parameter server "
        f"{','.join(args.param_server) or '(none)'}{processes}, listening on {address}"
        + (f"; its inference worker on {colocated_worker[3]}" if colocated_worker else ""),
    )
    wait_for(stop)
    if colocated_worker is not None:  # its streams get 5 s, as a worker process's do
        worker_server, worker, worker_client, _ = colocated_worker
        worker_server.stop(5.0).wait()
        worker.close()
        if worker_client is not None:
            worker_client.close()
    server.stop(5.0).wait()
    with servicer.lock:  # a step still running in a handler thread finishes first
        saved = served.save(wait=True)
        if isinstance(served, LeaderTrainer):
            served.stop_followers()
        trainer.close()
    print(f"trainer: saved step {saved}; stopped", file=sys.stderr, flush=True)
    if param_server is not None:
        param_server.close()
    return 0
