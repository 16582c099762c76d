"""The paged KV cache: storage by page table, equality with the dense reference cache, the
fresh prefill path equal to reading the pages, and greedy decoding through the real model
equal to full recompute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.inference.attention import UnsupportedShapeError, interpret_kernels
from rlax_tpu.inference.page_allocator import num_pages_for_budget
from rlax_tpu.inference.paged_cache import PagedKVCache
from rlax_tpu.models import DenseKVCache, Transformer

KV_HEADS, Q_HEADS, HEAD_DIM, PAGE_SIZE = 2, 4, 8, 4


def scattered_page_table(slots, pages_per_seq, num_pages, seed=0):
    """Every slot's row filled with pages in a shuffled order (never page 0)."""
    pages = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    return pages[: slots * pages_per_seq].reshape(slots, pages_per_seq).astype(np.int32)


def random_qkv(rng, slots, new):
    """float32 q: [slots, new, Q_HEADS, HEAD_DIM]; k, v: [slots, new, KV_HEADS, HEAD_DIM]."""
    return (
        rng.standard_normal((slots, new, Q_HEADS, HEAD_DIM), np.float32),
        rng.standard_normal((slots, new, KV_HEADS, HEAD_DIM), np.float32),
        rng.standard_normal((slots, new, KV_HEADS, HEAD_DIM), np.float32),
    )


def make_cache(slots, pages_per_seq, num_pages, num_layers=2, backend="jax", dtype=jnp.float32):
    return PagedKVCache.create(
        num_layers=num_layers,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        batch_slots=slots,
        pages_per_seq=pages_per_seq,
        dtype=dtype,
        attention_backend=backend,
    )


def test_token_lands_in_its_page_at_its_offset():
    cache = make_cache(slots=2, pages_per_seq=3, num_pages=8, num_layers=1)
    table = np.array([[5, 2, 7], [3, 0, 0]], np.int32)
    cache = cache.with_page_table(table)
    positions = np.array([[0, 5, 9], [1, 3, 2]], np.int32)
    valid = np.array([[True, True, True], [True, False, True]])
    q, k, v = random_qkv(np.random.default_rng(0), 2, 3)
    _, cache = jax.jit(lambda c, *a: c.attend(0, *a))(cache, q, k, v, positions, valid)
    keys = np.asarray(cache.keys[0])  # [kv_heads, num_pages, page_size, head_dim]
    for b, n in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]:
        p = positions[b, n]
        page = table[b, p // PAGE_SIZE]
        np.testing.assert_array_equal(keys[:, page, p % PAGE_SIZE], np.asarray(k[b, n]))
        np.testing.assert_array_equal(
            np.asarray(cache.values[0])[:, page, p % PAGE_SIZE], np.asarray(v[b, n])
        )
    # Exactly five tokens were written; the padding token (slot 1, position 3) was not.
    assert np.count_nonzero(np.abs(keys).sum(axis=(0, 3))) == 5


def test_padding_page_is_never_written():
    # Slot 1 has no page for positions >= 4: such writes (like padding) are dropped.
    cache = make_cache(slots=2, pages_per_seq=2, num_pages=4, num_layers=1)
    cache = cache.with_page_table(np.array([[1, 2], [3, 0]], np.int32))
    positions = np.array([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]], np.int32)
    valid = np.array([[True] * 4 + [False] * 2, [True] * 6])
    qkv = random_qkv(np.random.default_rng(0), 2, 6)
    _, cache = jax.jit(lambda c, *a: c.attend(0, *a))(cache, *qkv, positions, valid)
    assert not np.asarray(cache.keys[0])[:, 0].any()
    assert not np.asarray(cache.values[0])[:, 0].any()


def test_paged_attention_equals_dense_over_prefill_chunks_and_decode_steps():
    """Slots of different lengths (one empty, then filled by a later chunk), pages scattered
    over the pool, padding rows in every step and idle slots during decode."""
    slots, pages_per_seq, num_layers = 4, 6, 2
    max_len = pages_per_seq * PAGE_SIZE
    paged = make_cache(slots, pages_per_seq, num_pages=30, num_layers=num_layers)
    paged = paged.with_page_table(scattered_page_table(slots, pages_per_seq, 30))
    dense = DenseKVCache.create(
        num_layers=num_layers,
        batch=slots,
        max_len=max_len,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
    )
    lengths = np.array([5, 0, 11, 1])
    new = 11
    first = np.broadcast_to(np.arange(new, dtype=np.int32), (slots, new))
    steps = [(first, first < lengths[:, None])]
    # A second multi-token step: slot 1 prefills from 0, slot 2 continues from 11.
    chunk = np.zeros((slots, 7), np.int32)
    chunk[1], chunk[2] = np.arange(7), 11 + np.arange(7)
    chunk_valid = np.zeros((slots, 7), bool)
    chunk_valid[1], chunk_valid[2, :4] = True, True
    steps.append((chunk, chunk_valid))
    lengths = np.array([5, 7, 15, 1])
    for i in range(5):
        active = np.array([True, True, True, i % 2 == 0])  # slot 3 idles on odd steps
        steps.append((lengths[:, None].astype(np.int32), active[:, None]))
        lengths = lengths + active

    @jax.jit
    def both(paged, dense, qkvs, positions, valid):
        outs = []
        for layer, qkv in enumerate(qkvs):
            out, paged = paged.attend(layer, *qkv, positions, valid)
            want, dense = dense.attend(layer, *qkv, positions, valid)
            outs.append((out, want))
        return outs, paged, dense

    rng = np.random.default_rng(0)
    for positions, valid in steps:
        qkvs = [random_qkv(rng, slots, positions.shape[1]) for _ in range(num_layers)]
        outs, paged, dense = both(paged, dense, qkvs, positions, valid)
        mask = valid[:, :, None, None]
        for out, want in outs:
            np.testing.assert_allclose(
                np.where(mask, out, 0), np.where(mask, want, 0), atol=1e-5, rtol=1e-5
            )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_fresh_prefill_equals_reading_the_pages(dtype):
    """for_prefill stores what with_page_table stores and attends its own tokens to the same
    numbers up to rounding; the padding row (length 0) writes nothing."""
    slots, pages_per_seq, num_pages, bucket = 4, 4, 20, 12
    table = scattered_page_table(slots, pages_per_seq, num_pages)
    cache = make_cache(slots, pages_per_seq, num_pages, num_layers=1, dtype=dtype)
    lengths = np.array([5, 0, 12, 1])
    positions = np.broadcast_to(np.arange(bucket, dtype=np.int32), (slots, bucket))
    valid = positions < lengths[:, None]
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(np.random.default_rng(0), slots, bucket))
    attend = jax.jit(lambda c, *a: c.attend(0, *a))
    out, fresh = attend(cache.for_prefill(table), q, k, v, positions, valid)
    want, paged = attend(cache.with_page_table(table), q, k, v, positions, valid)
    assert fresh.fresh and not paged.fresh
    np.testing.assert_array_equal(np.asarray(fresh.keys[0]), np.asarray(paged.keys[0]))
    np.testing.assert_array_equal(np.asarray(fresh.values[0]), np.asarray(paged.values[0]))
    assert not np.asarray(fresh.keys[0])[:, table[1]].any()
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    mask = valid[:, :, None, None]
    np.testing.assert_allclose(
        np.where(mask, np.asarray(out, np.float32), 0),
        np.where(mask, np.asarray(want, np.float32), 0),
        **tolerance,
    )


def test_with_page_table_ends_a_fresh_step():
    cache = make_cache(slots=2, pages_per_seq=2, num_pages=5)
    table = np.array([[1, 2], [3, 4]], np.int32)
    fresh = jax.jit(lambda c: c)(cache.for_prefill(table[:1]))
    assert fresh.fresh and fresh.page_table.shape == (1, 2)
    after = fresh.with_page_table(table)
    assert not after.fresh
    assert jax.tree.structure(after) == jax.tree.structure(cache)


def test_paged_cache_is_a_pytree_usable_under_jit():
    cache = make_cache(slots=2, pages_per_seq=2, num_pages=5)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 2 * 2 + 1  # keys and values of two layers, the page table
    assert jax.jit(lambda c: c)(cache).backend == cache.backend


def test_from_config_sizes_the_pool_from_the_budget():
    model = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    inference = InferenceConfig(
        max_decode_slots=3, page_size=8, kv_cache_bytes=2**20, max_prompt_len=20, max_new_tokens=10
    )
    cache = PagedKVCache.from_config(model, inference)
    expected_pages = num_pages_for_budget(
        2**20, num_layers=2, kv_heads=2, head_dim=16, page_size=8, dtype="bfloat16"
    )
    assert cache.keys[0].shape == (2, expected_pages, 8, 16)
    assert cache.keys[0].dtype == jnp.bfloat16
    assert cache.page_table.shape == (3, 4)  # ceil(30 / 8) pages per slot
    assert cache.backend == "jax"  # auto on CPU
    allocator = cache.make_allocator()
    assert allocator.free_pages == expected_pages - 1


def test_pallas_backend_rejects_shapes_the_kernel_cannot_take():
    with interpret_kernels(), pytest.raises(UnsupportedShapeError, match="head_dim"):
        make_cache(slots=2, pages_per_seq=2, num_pages=5, backend="pallas")


# --- through the real model ------------------------------------------------------------

LLAMA = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
QWEN3 = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=8,
    qk_norm=True,
    tie_word_embeddings=True,
)


@jax.jit
def _decode(model, tokens, positions, valid, cache):
    return model.decode(tokens, positions, valid, cache)


class GreedySlots:
    """Greedy decoding of several sequences in fixed slots through a PagedKVCache,
    recording every logit row the cache path produced for each sequence."""

    def __init__(self, model, slots, pages_per_seq, num_pages):
        c = model.config
        self.model = model
        self.cache = PagedKVCache.create(
            num_layers=c.num_layers,
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            batch_slots=slots,
            pages_per_seq=pages_per_seq,
            dtype=jnp.float32,
            attention_backend="jax",
        )
        self.allocator = self.cache.make_allocator()
        self.tokens = [[] for _ in range(slots)]  # tokens fed so far
        self.logits = [[] for _ in range(slots)]  # one float32[vocab] row per fed token
        self.next = [None] * slots  # greedy token to feed next

    def _run(self, tokens, positions, valid, fresh=False):
        table = self.allocator.device_page_table()
        cache = self.cache.for_prefill(table) if fresh else self.cache.with_page_table(table)
        logits, self.cache = _decode(self.model, tokens, positions, valid, cache)
        logits = np.asarray(logits)
        for b, n in zip(*np.nonzero(valid), strict=True):
            self.tokens[b].append(int(tokens[b, n]))
            self.logits[b].append(logits[b, n])
            self.next[b] = int(np.argmax(logits[b, n]))

    def prefill(self, prompts: dict[int, list[int]], bucket: int):
        """Prefill prompts into their (fresh) slots in one padded step; other slots sit idle."""
        slots = len(self.tokens)
        tokens = np.zeros((slots, bucket), np.int32)
        positions = np.broadcast_to(np.arange(bucket, dtype=np.int32), (slots, bucket))
        valid = np.zeros((slots, bucket), bool)
        for slot, prompt in prompts.items():
            self.allocator.reserve(slot, len(prompt))
            tokens[slot, : len(prompt)] = prompt
            valid[slot, : len(prompt)] = True
        self._run(tokens, positions, valid, fresh=True)

    def step(self):
        """One greedy token for every slot holding a sequence."""
        slots = len(self.tokens)
        tokens = np.zeros((slots, 1), np.int32)
        positions = np.zeros((slots, 1), np.int32)
        valid = np.zeros((slots, 1), bool)
        for b in range(slots):
            if self.tokens[b]:
                self.allocator.reserve(b, len(self.tokens[b]) + 1)
                tokens[b, 0], positions[b, 0], valid[b, 0] = self.next[b], len(self.tokens[b]), 1
        self._run(tokens, positions, valid)

    def finish(self, slot):
        """Free the slot; returns (tokens, logits) of its sequence."""
        done = (self.tokens[slot], np.stack(self.logits[slot]))
        self.allocator.free(slot)
        self.tokens[slot], self.logits[slot] = [], []
        return done


def assert_matches_full_recompute(model, sequences):
    """Cache-path logits of each (tokens, logits) equal forward_train on the same tokens."""
    longest = max(len(tokens) for tokens, _ in sequences)
    batch = np.zeros((len(sequences), longest), np.int32)
    for i, (tokens, _) in enumerate(sequences):
        batch[i, : len(tokens)] = tokens
    want = jax.jit(lambda m, t: m.forward_train(t, t, return_logits=True).logits)(model, batch)
    for i, (tokens, logits) in enumerate(sequences):
        np.testing.assert_allclose(logits, np.asarray(want)[i, : len(tokens)], atol=2e-5, rtol=0)


def random_model(config, seed=0):
    """A model with numpy-drawn weights (no compiles), larger than HF's init so attention
    is far from uniform and a key read from the wrong place shows in the logits."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)

    def draw(p):
        noise = rng.standard_normal(p.shape).astype(np.float32)
        return jnp.asarray(1 + 0.1 * noise if p.ndim == 1 else 0.15 * noise, p.dtype)

    nnx.update(model, jax.tree.map(draw, nnx.state(model, nnx.Param)))
    return model


@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_greedy_decode_through_paged_cache_equals_full_recompute(config):
    model = random_model(config)
    # Prompt lengths around page boundaries; pages of different slots interleave as they grow.
    lengths = [1, 3, 4, 5, 8, 13]
    rng = np.random.default_rng(1)
    prompts = {s: rng.integers(0, config.vocab_size, n).tolist() for s, n in enumerate(lengths)}
    slots = GreedySlots(model, slots=len(lengths), pages_per_seq=8, num_pages=40)
    slots.prefill(prompts, bucket=16)
    for _ in range(6):
        slots.step()
    done = [slots.finish(0), slots.finish(3)]
    # Refill slot 0 with a new prompt on recycled (stale) pages while the others continue.
    slots.prefill({0: rng.integers(0, config.vocab_size, 9).tolist()}, bucket=16)
    for _ in range(4):
        slots.step()
    done += [slots.finish(s) for s in (0, 1, 2, 4, 5)]
    assert_matches_full_recompute(model, done)
