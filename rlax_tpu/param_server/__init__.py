"""The parameter server (DESIGN §3): versioned model weights from the trainer to the workers.

`VersionStore` keeps immutable versions (hot in memory, persisted with TensorStore on a
directory or gs://); `ParamServerServicer` serves it over gRPC; `rlax-tpu serve param-server`
runs it as a process (`server`). `layout` defines pieces, boxes and digests for both ends,
`wire` the codec of the messages carrying bytes, `errors` the errors both ends raise;
`ParamServerClient` talks to it (JAX only for publish and pull, `arrays`). Names load on
first use, so a client does not load the store and TensorStore, nor a server the client's
JAX.
"""

from rlax_tpu._lazy import lazy_exports

# Public name -> the submodule defining it; imported on first use (rlax_tpu._lazy).
_EXPORTS = {
    "Box": "layout",
    "Piece": "layout",
    "InvalidPublishError": "errors",
    "InvalidReadError": "errors",
    "LayoutMismatchError": "errors",
    "ParamServerError": "errors",
    "PublishInProgressError": "errors",
    "PullMismatchError": "errors",
    "StorageFailedError": "errors",
    "VersionConflictError": "errors",
    "VersionNotFoundError": "errors",
    "decode_publish_request": "wire",
    "decode_pull_chunks": "wire",
    "encode_piece_chunks": "wire",
    "RunningServer": "server",
    "ServeOptions": "server",
    "start_server": "server",
    "STATUS_CODES": "service",
    "ParamServerServicer": "service",
    "PublishResult": "records",
    "PublishTransaction": "publish",
    "VersionInfo": "records",
    "VersionStore": "store",
    "ParamServerCallError": "client",
    "ParamServerClient": "client",
    "PublishReceipt": "client",
    "ReplicaPlan": "client",
    "split_dims_from_logical": "client",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
