"""gRPC plumbing shared by every component: servers, channels, token auth, the Health service.

Messages and stubs generated from protos/ are in `rlax_tpu.rpc.protos` (e.g. `common_pb2`).
"""

from rlax_tpu.rpc.auth import (
    DEFAULT_AUTH_TOKEN_ENV,
    AuthChannel,
    AuthTokenError,
    ServerAuthInterceptor,
    auth_token_from_env,
)
from rlax_tpu.rpc.channels import MAX_MESSAGE_BYTES, format_address, make_channel, make_server
from rlax_tpu.rpc.client import (
    ComponentClient,
    ComponentUnreachableError,
    RpcCallError,
    is_unreachable,
    retry_unreachable,
)
from rlax_tpu.rpc.health import HealthServicer, get_status
from rlax_tpu.rpc.protos import common_pb2, common_pb2_grpc

__all__ = [
    "DEFAULT_AUTH_TOKEN_ENV",
    "MAX_MESSAGE_BYTES",
    "RpcCallError",
    "AuthTokenError",
    "AuthChannel",
    "ComponentClient",
    "ComponentUnreachableError",
    "HealthServicer",
    "ServerAuthInterceptor",
    "auth_token_from_env",
    "common_pb2",
    "common_pb2_grpc",
    "format_address",
    "get_status",
    "is_unreachable",
    "make_channel",
    "make_server",
    "retry_unreachable",
]
