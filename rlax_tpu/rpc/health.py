"""The Health service every component serves: who it is, which version and config it holds.

The controller calls GetStatus to check that a fleet is up and consistent (same config
digest, expected versions) before it drives it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

from rlax_tpu.rpc.protos import common_pb2, common_pb2_grpc

StatusFn = Callable[[], Mapping[str, Any]]


class HealthServicer(common_pb2_grpc.HealthServicer):
    """Serves `status_fn()`: a mapping of ComponentStatus fields (component, instance_id,
    version, config_digest, details)."""

    def __init__(self, status_fn: StatusFn) -> None:
        self._status_fn = status_fn

    def GetStatus(
        self, request: common_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> common_pb2.ComponentStatus:
        try:
            return common_pb2.ComponentStatus(**self._status_fn())
        except Exception as e:  # report why, instead of gRPC's bare "Exception calling application"
            context.abort(
                grpc.StatusCode.INTERNAL, f"status callback failed: {type(e).__name__}: {e}"
            )

    def add_to_server(self, server: grpc.Server) -> None:
        common_pb2_grpc.add_HealthServicer_to_server(self, server)


def get_status(channel: grpc.Channel, *, timeout_s: float = 10.0) -> common_pb2.ComponentStatus:
    """Ask the component behind `channel` for its status."""
    return common_pb2_grpc.HealthStub(channel).GetStatus(
        common_pb2.StatusRequest(), timeout=timeout_s
    )
