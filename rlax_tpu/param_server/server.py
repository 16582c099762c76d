"""The parameter server process behind `rlax-tpu serve param-server`.

Opens a VersionStore on the run's storage (serving every version committed there before),
serves ParamServer and Health on one gRPC server, bound to loopback unless told otherwise,
prints `READY host:port` on stdout once serving, and stops gracefully on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import grpc

from rlax_tpu.config import ConfigError, RunConfig, load_config
from rlax_tpu.param_server.service import ParamServerServicer
from rlax_tpu.param_server.store import VersionStore
from rlax_tpu.rpc import (
    DEFAULT_AUTH_TOKEN_ENV,
    AuthTokenError,
    HealthServicer,
    auth_token_from_env,
    format_address,
    make_server,
)
from rlax_tpu.rpc.process import announce_ready, stop_on_signals, wait_for


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """Everything the server process needs; `storage_url` None = memory only."""

    storage_url: str | None
    hot_versions: int
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    replica: int = 0
    num_replicas: int = 1
    chunk_bytes: int = 2 * 2**20
    auth_token_env: str = DEFAULT_AUTH_TOKEN_ENV
    config_digest: str = ""
    # Each streaming call holds a thread for its whole duration (many workers pull at once).
    max_workers: int = 32


@dataclasses.dataclass
class RunningServer:
    """A started server: its store, the gRPC server and the address it listens on."""

    store: VersionStore
    servicer: ParamServerServicer
    server: grpc.Server
    host: str
    port: int

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls, let running ones finish for up to `grace_s`, then cancel.
        Pulls waiting for a version that has not committed end at once (as a pull of a
        missing version): a worker's prefetch of the next version must not hold the stop."""
        self.servicer.store.stop_waiting()
        self.server.stop(grace_s).wait()
        self.servicer.close()


def start_server(options: ServeOptions, *, auth_token: str) -> RunningServer:
    """Open the store and start serving it (ParamServer + Health); returns once listening."""
    store = VersionStore(
        options.storage_url,
        hot_versions=options.hot_versions,
        replica=options.replica,
        num_replicas=options.num_replicas,
    )
    servicer = ParamServerServicer(
        store, chunk_bytes=options.chunk_bytes, max_waiting_pulls=options.max_workers // 2
    )
    server, port = make_server(
        options.host,
        options.port,
        auth_token=auth_token,
        auth_token_env=options.auth_token_env,
        max_workers=options.max_workers,
    )
    servicer.add_to_server(server)
    HealthServicer(lambda: _status(store, options)).add_to_server(server)
    server.start()
    return RunningServer(store, servicer, server, options.host, port)


def _status(store: VersionStore, options: ServeOptions) -> Mapping[str, Any]:
    versions = store.versions()
    return {
        "component": "param_server",
        "instance_id": f"param_server-{options.replica}",
        "version": versions[-1].version if versions else -1,
        "config_digest": options.config_digest,
        "details": {
            "versions": str(len(versions)),
            "in_memory": str(sum(v.in_memory for v in versions)),
            "hot_versions": str(options.hot_versions),
            "replica": f"{options.replica}/{options.num_replicas}",
            "storage": options.storage_url or "(memory only)",
        },
    }


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """Resolve the CLI: the config file (or the defaults) with --set, then the flags."""
    config = load_config(args.config, args.overrides) if args.config else None
    # The digest Health reports is the run's config, before this process's own flags.
    config_digest = config.digest() if config is not None else ""
    flags = []
    for flag, key in (
        ("hot_versions", "param_server.hot_versions"),
        ("chunk_bytes", "param_server.chunk_bytes"),
        ("num_replicas", "param_server.num_replicas"),
        ("host", "param_server.host"),
    ):
        if getattr(args, flag) is not None:
            flags.append(f"{key}={getattr(args, flag)}")
    resolved = (config or RunConfig().apply_overrides(args.overrides)).apply_overrides(flags)
    ps = resolved.param_server
    if not 0 <= args.replica < ps.num_replicas:
        raise ConfigError(
            f"--replica must be in [0, {ps.num_replicas}) (param_server.num_replicas), "
            f"got {args.replica}"
        )
    if args.memory_only:
        storage_url = None
    elif args.storage:
        storage_url = args.storage
    elif config is not None:
        storage_url = config.storage.path("params")
    else:
        raise ConfigError(
            "no storage: pass --storage URL (a directory, file:// or gs://), a CONFIG (storage "
            "is then {storage.run_dir}/params), or --memory-only"
        )
    return ServeOptions(
        storage_url=storage_url,
        hot_versions=resolved.hot_versions,
        host=ps.host,
        port=args.port,
        replica=args.replica,
        num_replicas=ps.num_replicas,
        chunk_bytes=ps.chunk_bytes,
        auth_token_env=ps.auth_token_env,
        config_digest=config_digest,
    )


def main(args: argparse.Namespace) -> int:
    """`rlax-tpu serve param-server`: serve until SIGTERM or SIGINT, then exit 0."""
    options = options_from_args(args)  # ConfigError: the CLI prints it and exits 2
    try:
        token = auth_token_from_env(options.auth_token_env)
    except AuthTokenError as e:
        print(f"rlax-tpu serve param-server: {e}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    try:
        running = start_server(options, auth_token=token)
    except OSError as e:  # the port is taken
        print(f"rlax-tpu serve param-server: {e}", file=sys.stderr)
        return 2
    versions = running.store.versions()
    announce_ready(
        running.address,
        f"param server replica {options.replica}/{options.num_replicas}: "
        f"{len(versions)} committed versions on {options.storage_url or '(memory only)'}, "
        f"K={options.hot_versions}, listening on {running.address}",
    )
    wait_for(stop)
    running.stop()
    return 0
