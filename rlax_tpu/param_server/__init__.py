"""The parameter server (DESIGN §3): versioned model weights from the trainer to the workers.

`VersionStore` keeps immutable versions on TensorStore (hot in memory, persisted on a
directory or gs://); `ParamServerServicer` serves it over gRPC; `rlax-tpu serve param-server`
runs it as a process (`server`). `layout` defines pieces, boxes and digests for both ends.
"""

from rlax_tpu.param_server.layout import Box, Piece
from rlax_tpu.param_server.server import RunningServer, ServeOptions, start_server
from rlax_tpu.param_server.service import STATUS_CODES, ParamServerServicer, decode_pull_chunk
from rlax_tpu.param_server.store import (
    InvalidPublishError,
    InvalidReadError,
    LayoutMismatchError,
    ParamServerError,
    PublishInProgressError,
    PublishResult,
    PublishTransaction,
    StorageFailedError,
    VersionConflictError,
    VersionInfo,
    VersionNotFoundError,
    VersionStore,
)

__all__ = [
    "STATUS_CODES",
    "Box",
    "InvalidPublishError",
    "InvalidReadError",
    "LayoutMismatchError",
    "ParamServerError",
    "ParamServerServicer",
    "Piece",
    "PublishInProgressError",
    "PublishResult",
    "PublishTransaction",
    "RunningServer",
    "ServeOptions",
    "StorageFailedError",
    "VersionConflictError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionStore",
    "decode_pull_chunk",
    "start_server",
]

# The client imports JAX; load it only when asked for, so the server process starts fast.
_CLIENT_NAMES = (
    "ParamServerCallError",
    "ParamServerClient",
    "PublishReceipt",
    "ReplicaPlan",
    "flatten",
    "split_dims_from_logical",
    "unflatten_like",
)
__all__ += list(_CLIENT_NAMES)


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        from rlax_tpu.param_server import client

        return getattr(client, name)
    raise AttributeError(f"module 'rlax_tpu.param_server' has no attribute {name!r}")
