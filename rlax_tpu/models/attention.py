"""Causal self-attention of whole sequences (the training forward), one function per backend.

"reference": float32 scores [b, kv, g, s, s] and an explicit mask (every platform; the
numbers the others are tested against). "splash": Pallas splash attention (TPU; interpreted
elsewhere), blockwise, so no [s, s] array exists, with its own backward kernels. "dot_product":
`jax.nn.dot_product_attention` (cuDNN's fused kernel on GPU). All take q: [b, s, q_heads, d]
(RoPE applied), k, v: [b, s, kv_heads, d] and optional segment_ids: int32[b, s] (tokens attend
only within their segment; 0 = padding) and return [b, s, q_heads, d] in q's dtype. The
reference and dot_product also take prefix_ids: int32[b, s], the segment a token attends to
besides its own (a shared prompt, rlax_tpu.trainer.packing; 0 = none); splash does not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask_info as splash_mask_info,
)
from jax.sharding import PartitionSpec

from rlax_tpu.models.kv_cache import MASK_VALUE, grouped_attention
from rlax_tpu.sharding import active_mesh, logical_spec, target_platform

# Splash blocks: a multiple of the TPU's 128 lanes; sequences are padded up to a block.
SPLASH_LANES = 128
SPLASH_MAX_BLOCK = 512


def causal_mask(
    batch: int, seq: int, segment_ids: jax.Array | None, prefix_ids: jax.Array | None = None
) -> jax.Array:
    """bool[b, s, s]: query t sees key u <= t of its own (non-padding) segment, and of the
    segment `prefix_ids` names for it (a shared prompt laid out before it)."""
    causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))[None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, seq, seq))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        same = same | (prefix_ids[:, :, None] == segment_ids[:, None, :])
    return causal & same & (segment_ids[:, None, :] != 0)


def reference_attention(q, k, v, segment_ids=None, prefix_ids=None):
    batch, seq = q.shape[:2]
    return grouped_attention(q, k, v, causal_mask(batch, seq, segment_ids, prefix_ids))


def dot_product_attention(q, k, v, segment_ids=None, prefix_ids=None):
    """jax.nn.dot_product_attention, causal (grouped-query heads taken as they are). With
    segment ids a boolean mask is passed, which cuDNN takes as a bias."""
    mask = None
    if segment_ids is not None:
        mask = causal_mask(q.shape[0], q.shape[1], segment_ids, prefix_ids)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None)


def _splash_block(seq: int) -> int:
    """The largest block (a multiple of 128, at most 512) dividing `seq` (itself a multiple
    of 128)."""
    return max(b for b in range(SPLASH_LANES, SPLASH_MAX_BLOCK + 1, SPLASH_LANES) if seq % b == 0)


@functools.cache
def _splash_kernel(group: int, seq: int, interpret: bool):
    """A splash kernel for one kv head's `group` query heads (MQA form) over [seq, seq],
    causal. Cached: building the mask's block tables walks the whole [seq, seq] grid."""
    block = _splash_block(seq)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((seq, seq))] * group)
    # What splash's make_splash_mqa does, minus its jnp.array of the block tables: those stay
    # numpy (constants of whichever trace uses the cached kernel), which also works under a
    # mesh of abstract TPU devices where a concrete device array cannot be made.
    tables = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1)
    fwd, mask_function = splash_mask_info.process_mask(mask, (block, block), **tables)
    dq, _ = splash_mask_info.process_mask(mask, (block, block), **tables)
    dkv, _ = splash_mask_info.process_mask_dkv(mask, (block, block), shrink_grid=True, **tables)
    return splash.SplashAttentionKernel(
        fwd,
        dq,
        dkv,
        block_sizes=sizes,
        is_mqa=True,
        save_residuals=False,
        mask_value=MASK_VALUE,
        attn_logits_soft_cap=None,
        residual_checkpoint_name=None,
        mask_function=mask_function,
        interpret=interpret,
    )


def splash_attention(q, k, v, segment_ids=None, prefix_ids=None):
    """Splash attention: vmapped over batch rows and kv heads (each kv head serves its group
    of query heads as one MQA kernel call), under shard_map when a mesh is active so that
    every device runs the kernel on its own rows and heads.

    The sequence is padded to a multiple of 128 with segment id 0 keys after every real
    token (causality hides them); q is scaled by d**-0.5 before the kernel, which does not
    scale scores. Its masks compare segment ids for equality only: shared prompts
    (`prefix_ids`) are refused.
    """
    if prefix_ids is not None:
        raise ValueError(
            "splash attention cannot attend to a shared prompt's segment "
            "(trainer.share_prefixes): set trainer.attention_backend=jax, or "
            "trainer.share_prefixes=false"
        )
    batch, seq, q_heads, d = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    padded = -(-seq // SPLASH_LANES) * SPLASH_LANES
    if padded != seq:
        pad = [(0, 0), (0, padded - seq), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, [(0, 0), (0, padded - seq)])
    # [b, kv, g, s, d] queries; [b, kv, s, d] keys and values.
    qg = (q * jnp.asarray(d**-0.5, q.dtype)).reshape(batch, padded, kv_heads, group, d)
    qg = qg.transpose(0, 2, 3, 1, 4)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    kernel = _splash_kernel(group, padded, target_platform() != "tpu")

    def per_device(qg, kt, vt, seg):
        def one(qh, kh, vh, s):  # [g, s, d], [s, d], [s, d], [s] or None
            ids = None if s is None else splash.SegmentIds(q=s, kv=s)
            return kernel(qh, kh, vh, segment_ids=ids)

        over_heads = jax.vmap(one, in_axes=(0, 0, 0, None))
        return jax.vmap(over_heads, in_axes=(0, 0, 0, 0 if seg is not None else None))(
            qg, kt, vt, seg
        )

    mesh = active_mesh()
    if mesh is None:
        out = per_device(qg, kt, vt, segment_ids)
    else:
        q_spec = logical_spec(("batch", "act_kv_heads", None, None, None), qg.shape)
        kv_spec = PartitionSpec(*q_spec[:2], None, None)
        seg_spec = PartitionSpec(q_spec[0], None)
        out = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, None if segment_ids is None else seg_spec),
            out_specs=q_spec,
            check_vma=False,
        )(qg, kt, vt, segment_ids)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, q_heads, d)
    return out[:, :seq].astype(q.dtype)


ATTENTION = {
    "reference": reference_attention,
    "splash": splash_attention,
    "dot_product": dot_product_attention,
}


def train_attention(name: str):
    """The attention function of a resolved backend name (rlax_tpu.models.options)."""
    try:
        return ATTENTION[name]
    except KeyError:
        raise ValueError(
            f"unknown training attention {name!r}; one of {sorted(ATTENTION)}"
        ) from None


__all__ = [
    "causal_mask",
    "dot_product_attention",
    "reference_attention",
    "splash_attention",
    "train_attention",
]
