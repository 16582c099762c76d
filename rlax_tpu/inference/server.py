"""The inference worker process behind `rlax-tpu serve inference`.

Builds the engine on the config's inference mesh, connects to the parameter server
(--param-server, replicas in order), serves InferenceWorker and Health on one gRPC server
bound to loopback unless told otherwise, prints `READY host:port` on stdout once serving
(and `PROGRESS` lines for its first weight load and first compiles), and stops gracefully on
SIGTERM or SIGINT.

It joins a multi-host job when the environment describes one (rlax_tpu.distributed), and
refuses to serve when that job has more than one process: a worker's engine does not run in
lockstep across hosts, so each host runs its own worker.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from rlax_tpu.rpc import format_address
from rlax_tpu.rpc.process import (
    announce_progress,
    announce_ready,
    bind_server,
    component_config,
    join_distributed_job,
    stop_on_signals,
    wait_for,
)

_log = logging.getLogger(__name__)

DEFAULT_WORKER_ID = "inference_worker-0"
# Each Generate stream holds a server thread until its batch is done; many callers share
# the engine, so allow many streams at once.
_MAX_STREAMS = 64


def serve_worker(
    config: Any,
    *,
    token: str,
    host: str,
    port: int,
    worker_id: str,
    param_server: Sequence[str],
    stop: threading.Event,
    shared: Any = None,
) -> tuple[Any, Any, Any, str] | None:
    """Build an inference worker on the config's inference mesh, connected to the parameter
    server replicas at `param_server` (none: it pulls nothing), and serve it (InferenceWorker
    and Health) on host:port, started. Returns (gRPC server, worker, its parameter-server
    client or None, address), or None after saying why the port cannot be bound. `shared`:
    the versions a trainer in this process hands it (inference.colocated)."""
    from rlax_tpu.inference.service import InferenceWorkerServicer, worker_status
    from rlax_tpu.inference.worker import InferenceWorker
    from rlax_tpu.param_server.trees import TreeClient
    from rlax_tpu.rpc import HealthServicer
    from rlax_tpu.sharding import build_mesh

    client = (
        TreeClient(
            list(param_server),
            auth_token=token,
            chunk_bytes=config.param_server.chunk_bytes,
            reconnect_s=config.controller.component_wait_s,  # a restarted server is waited for
            on_retry=_log.warning,
            stop=stop,  # but not by a stopping worker: it exits at once
        )
        if param_server
        else None
    )
    worker = InferenceWorker(
        config,
        param_server=client,
        consumer_id=worker_id,
        mesh=build_mesh(config.inference.mesh),
        progress=announce_progress,
        shared=shared,
    )
    bound = bind_server("inference", config, host, port, auth_token=token, max_workers=_MAX_STREAMS)
    if bound is None:
        worker.close()
        if client is not None:
            client.close()
        return None
    server, bound_port = bound
    InferenceWorkerServicer(worker).add_to_server(server)
    digest = config.digest()
    HealthServicer(
        lambda: worker_status(worker, instance_id=worker_id, config_digest=digest)
    ).add_to_server(server)
    server.start()
    return server, worker, client, format_address(host, bound_port)


def main(args: argparse.Namespace) -> int:
    """`rlax-tpu serve inference`: serve until SIGTERM or SIGINT, then exit 0."""
    resolved = component_config(args, "inference")
    if resolved is None:
        return 2
    config, token = resolved
    distributed = join_distributed_job("inference")  # before anything touches a device
    if distributed is None:
        return 2
    if distributed.is_multi_process:
        import jax

        if jax.process_count() > 1:
            # The engine schedules requests as they arrive; processes sharing one mesh
            # would have to run the same schedule in lockstep, which it does not do yet.
            print(
                f"rlax-tpu serve inference: this worker is {distributed.describe()}, but an "
                "inference worker runs on one host's devices: run one worker per host (leave "
                "RLAX_TPU_NUM_PROCESSES and RLAX_TPU_DISTRIBUTED unset for it) and list each "
                "in the controller's worker addresses",
                file=sys.stderr,
            )
            return 2

    worker_id = args.worker_id or DEFAULT_WORKER_ID
    host = args.host or "127.0.0.1"
    stop = stop_on_signals()
    served = serve_worker(
        config,
        token=token,
        host=host,
        port=args.port,
        worker_id=worker_id,
        param_server=args.param_server,
        stop=stop,
    )
    if served is None:
        return 2
    server, worker, param_server, address = served
    announce_ready(
        address,
        f"inference worker {worker_id}: {config.model.architecture} on mesh "
        f"{dict(worker.mesh.shape)}, parameter server {args.param_server or '(none)'}, "
        f"listening on {address}",
    )
    wait_for(stop)
    server.stop(5.0).wait()  # running streams get 5 s; then the worker aborts what is left
    worker.close()
    if param_server is not None:
        param_server.close()
    return 0
