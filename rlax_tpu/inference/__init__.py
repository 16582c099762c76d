"""The inference worker (DESIGN §4): a paged KV cache over a shared page pool, its host-side
page allocator, and the attention backends (pure JAX, Pallas TPU/GPU kernels)."""

from rlax_tpu.inference.attention import (
    Backend,
    UnsupportedShapeError,
    gather_pages,
    paged_attention,
    paged_attention_jax,
    paged_decode_attention_gpu,
    paged_decode_attention_tpu,
    resolve_backend,
)
from rlax_tpu.inference.page_allocator import (
    PADDING_PAGE,
    OutOfPagesError,
    PageAllocator,
    SequenceTooLongError,
    num_pages_for_budget,
)
from rlax_tpu.inference.paged_cache import PagedKVCache

__all__ = [
    "PADDING_PAGE",
    "Backend",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVCache",
    "SequenceTooLongError",
    "UnsupportedShapeError",
    "gather_pages",
    "num_pages_for_budget",
    "paged_attention",
    "paged_attention_jax",
    "paged_decode_attention_gpu",
    "paged_decode_attention_tpu",
    "resolve_backend",
]

# --- The worker (weights by version, idempotent generation) and its gRPC service -------------
from rlax_tpu.inference.service import (  # noqa: E402
    InferenceCallError,
    InferenceWorkerClient,
    InferenceWorkerServicer,
)
from rlax_tpu.inference.worker import (  # noqa: E402
    InferenceWorker,
    InferenceWorkerError,
    InvalidRequestError,
    LoadResult,
    NoParamServerError,
    NotLoadableError,
    NotLoadedError,
    PullFailedError,
    RolloutStream,
    UnknownVersionError,
    VersionMismatchError,
    WorkerClosedError,
)

__all__ += [
    "InferenceCallError",
    "InferenceWorker",
    "InferenceWorkerClient",
    "InferenceWorkerError",
    "InferenceWorkerServicer",
    "InvalidRequestError",
    "LoadResult",
    "NoParamServerError",
    "NotLoadableError",
    "NotLoadedError",
    "PullFailedError",
    "RolloutStream",
    "UnknownVersionError",
    "VersionMismatchError",
    "WorkerClosedError",
]

# --- The engine (continuous batching) and its sampler -----------------------------------------
from rlax_tpu.inference.engine import (  # noqa: E402
    Engine,
    EngineNotLoadedError,
    GenerationRequest,
    ParamsMismatchError,
    Rollout,
)
from rlax_tpu.inference.sampling import SamplingParams, request_key  # noqa: E402

__all__ += [
    "Engine",
    "EngineNotLoadedError",
    "GenerationRequest",
    "ParamsMismatchError",
    "Rollout",
    "SamplingParams",
    "request_key",
]
