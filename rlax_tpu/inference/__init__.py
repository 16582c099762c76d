"""The inference worker (DESIGN §4): a paged KV cache over a shared page pool, its host-side
page allocator (with host copies of swapped-out sequences), the attention backends (pure
JAX, Pallas TPU/GPU kernels), the engine, and the pool's capacity in sequences."""

from rlax_tpu._lazy import lazy_exports

# Public name -> the submodule defining it; imported on first use (rlax_tpu._lazy).
_EXPORTS = {
    "Backend": "attention",
    "UnsupportedShapeError": "attention",
    "fresh_attention": "attention",
    "gather_pages": "attention",
    "interpret_kernels": "attention",
    "paged_attention": "attention",
    "paged_attention_jax": "attention",
    "paged_decode_attention_jax": "attention",
    "paged_decode_attention_gpu": "attention",
    "paged_decode_attention_tpu": "attention",
    "resolve_backend": "attention",
    "PADDING_PAGE": "page_allocator",
    "OutOfPagesError": "page_allocator",
    "PageAllocator": "page_allocator",
    "SequenceTooLongError": "page_allocator",
    "num_pages_for_budget": "page_allocator",
    "PagedKVCache": "paged_cache",
    "HostPages": "page_allocator",
    "KvCapacity": "capacity",
    "kv_capacity": "capacity",
    "InferenceCallError": "client",
    "InferenceWorkerClient": "client",
    "InferenceWorkerServicer": "service",
    "InferenceWorker": "worker",
    "InferenceWorkerError": "worker",
    "InvalidRequestError": "worker",
    "LoadResult": "types",
    "NoParamServerError": "worker",
    "NotLoadableError": "worker",
    "NotLoadedError": "worker",
    "PullFailedError": "worker",
    "RolloutStream": "worker",
    "UnknownVersionError": "worker",
    "VersionMismatchError": "worker",
    "WorkerClosedError": "worker",
    "Engine": "engine",
    "EngineNotLoadedError": "engine",
    "GenerationRequest": "types",
    "ParamsMismatchError": "weights",
    "Rollout": "types",
    "SamplingParams": "types",
    "request_key": "sampling",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
