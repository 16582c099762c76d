"""The inference worker (DESIGN §4): a paged KV cache over a shared page pool, its host-side
page allocator (with host copies of swapped-out sequences), the attention backends (pure
JAX, Pallas TPU/GPU kernels), the engine, and the pool's capacity in sequences."""
