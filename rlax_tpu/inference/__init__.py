"""The inference worker (DESIGN §4): a paged KV cache over a shared page pool, its host-side
page allocator (with host copies of swapped-out sequences), the attention backends (pure
JAX, Pallas TPU/GPU kernels), the engine, and the pool's capacity in sequences."""

from rlax_tpu.inference.attention import (
    Backend,
    UnsupportedShapeError,
    fresh_attention,
    gather_pages,
    interpret_kernels,
    paged_attention,
    paged_attention_jax,
    paged_decode_attention_gpu,
    paged_decode_attention_jax,
    paged_decode_attention_tpu,
    resolve_backend,
)
from rlax_tpu.inference.capacity import KvCapacity, kv_capacity
from rlax_tpu.inference.engine import Engine, EngineNotLoadedError
from rlax_tpu.inference.page_allocator import (
    PADDING_PAGE,
    HostPages,
    OutOfPagesError,
    PageAllocator,
    SequenceTooLongError,
    num_pages_for_budget,
)
from rlax_tpu.inference.paged_cache import PagedKVCache
from rlax_tpu.inference.sampling import request_key
from rlax_tpu.inference.service import InferenceWorkerServicer
from rlax_tpu.inference.weights import ParamsMismatchError
from rlax_tpu.inference.worker import InferenceWorker, RolloutStream

__all__ = [
    "Backend",
    "Engine",
    "EngineNotLoadedError",
    "HostPages",
    "InferenceWorker",
    "InferenceWorkerServicer",
    "KvCapacity",
    "OutOfPagesError",
    "PADDING_PAGE",
    "PageAllocator",
    "PagedKVCache",
    "ParamsMismatchError",
    "RolloutStream",
    "SequenceTooLongError",
    "UnsupportedShapeError",
    "fresh_attention",
    "gather_pages",
    "interpret_kernels",
    "kv_capacity",
    "num_pages_for_budget",
    "paged_attention",
    "paged_attention_jax",
    "paged_decode_attention_gpu",
    "paged_decode_attention_jax",
    "paged_decode_attention_tpu",
    "request_key",
    "resolve_backend",
]
