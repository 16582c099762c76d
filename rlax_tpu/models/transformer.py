"""The decoder-only transformer family: Llama 3 (incl. its RoPE scaling), Qwen2 (qkv
bias) and Qwen3 (q/k RMSNorm), in Flax NNX.

Parameters carry logical axis names (see rlax_tpu.sharding); activations are
constrained by name. Two entry points: `forward_train` over whole sequences (per-token
log-probs of given targets) and `decode` through a KV cache (rlax_tpu.models.kv_cache).
Norms, softmax and logits are float32; matmuls run in `config.dtype`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.kv_cache import KVCache, grouped_attention
from rlax_tpu.models.options import REFERENCE, ForwardOptions
from rlax_tpu.sharding import constrain
from rlax_tpu.tree import flatten

_INIT_STD = 0.02  # Hugging Face's default initializer_range


def _dtype(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _param(rngs: nnx.Rngs, shape, logical_axes, dtype, init: str = "normal") -> nnx.Param:
    if init == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, (dim,), ("norm",), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # As in the reference implementation: cast back, then scale.
        return self.scale.get_value().astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """float32[head_dim // 2] inverse frequencies, with the config's RoPE scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate x: [batch, seq, heads, head_dim] by positions: int32[batch, seq].

    Half-split layout (the first and second halves of head_dim form the pairs), as in HF.
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, d/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pd = _dtype(c.param_dtype)
        self.config = c
        self.wq = _param(
            rngs, (c.hidden_size, c.num_heads, c.head_dim), ("embed", "heads", "head_dim"), pd
        )
        self.wk = _param(
            rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), pd
        )
        self.wv = _param(
            rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), pd
        )
        self.wo = _param(
            rngs, (c.num_heads, c.head_dim, c.hidden_size), ("heads", "head_dim", "embed"), pd
        )
        if c.qkv_bias:
            self.bq = _param(rngs, (c.num_heads, c.head_dim), ("heads", "head_dim"), pd, "zeros")
            self.bk = _param(
                rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), pd, "zeros"
            )
            self.bv = _param(
                rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), pd, "zeros"
            )
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
        """x: [b, s, embed] -> q: [b, s, heads, d], k, v: [b, s, kv_heads, d], RoPE applied."""
        dt = x.dtype
        q = jnp.einsum("bse,ehd->bshd", x, self.wq.get_value().astype(dt))
        k = jnp.einsum("bse,ehd->bshd", x, self.wk.get_value().astype(dt))
        v = jnp.einsum("bse,ehd->bshd", x, self.wv.get_value().astype(dt))
        if self.config.qkv_bias:
            q = q + self.bq.get_value().astype(dt)
            k = k + self.bk.get_value().astype(dt)
            v = v + self.bv.get_value().astype(dt)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
        k = constrain(k, ("batch", "length", "act_kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
        return q, k, v

    def out(self, attn: jax.Array) -> jax.Array:
        y = jnp.einsum("bshd,hde->bse", attn, self.wo.get_value().astype(attn.dtype))
        return constrain(y, ("batch", "length", "act_embed"))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, _dtype(config.param_dtype)
        self.w_gate = _param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pd)
        self.w_up = _param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pd)
        self.w_down = _param(rngs, (c.intermediate_size, c.hidden_size), ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        gate = jnp.einsum("bse,em->bsm", x, self.w_gate.get_value().astype(dt))
        up = jnp.einsum("bse,em->bsm", x, self.w_up.get_value().astype(dt))
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        y = jnp.einsum("bsm,me->bse", h, self.w_down.get_value().astype(dt))
        return constrain(y, ("batch", "length", "act_embed"))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        pd = _dtype(config.param_dtype)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)


class TrainOutput(NamedTuple):
    logprobs: jax.Array  # float32[batch, seq]: log π(targets[b, t] | tokens[b, :t+1])
    logits: jax.Array | None  # float32[batch, seq, vocab] (/ temperature) when asked for
    values: jax.Array | None  # float32[batch, seq] when the model has a value head


class Transformer(nnx.Module):
    """Llama 3 / Qwen2 / Qwen3 decoder. Build with `Transformer(config, rngs=nnx.Rngs(seed))`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, _dtype(config.param_dtype)
        self.config = c
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, pd, rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), pd)
        if c.value_head:
            self.value_w = _param(rngs, (c.hidden_size,), ("embed",), pd, "zeros")
            self.value_b = _param(rngs, (), (), pd, "zeros")

    # -- pieces ---------------------------------------------------------------------
    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed.get_value(), tokens, axis=0).astype(_dtype(self.config.dtype))
        # The gather comes out sharded like the table (embed over fsdp); gathering it whole
        # first makes the move to batch sharding a local slice (and says so to XLA).
        x = constrain(x, (None, None, None))
        return constrain(x, ("batch", "length", "act_embed"))

    def _logits(self, h: jax.Array) -> jax.Array:
        """h: [b, s, embed] (final-normed) -> float32[b, s, vocab]."""
        if self.config.tie_word_embeddings:
            w = self.embed.get_value().astype(h.dtype)
            logits = jnp.einsum("bse,ve->bsv", h, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head.get_value().astype(h.dtype)
            logits = jnp.einsum("bse,ev->bsv", h, w, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))

    def _values(self, h: jax.Array) -> jax.Array:
        w = self.value_w.get_value().astype(jnp.float32)
        return jnp.einsum("bse,e->bs", h.astype(jnp.float32), w) + self.value_b.get_value()

    def _layer(self, layer: DecoderLayer, x, positions, inv_freq, attend):
        q, k, v = layer.attn.qkv(layer.attn_norm(x), positions, inv_freq)
        x = x + layer.attn.out(attend(q, k, v))
        return x + layer.mlp(layer.mlp_norm(x))

    # -- entry points -----------------------------------------------------------------
    def hidden_states(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        options: ForwardOptions = REFERENCE,
    ) -> jax.Array:
        """Final-normed hidden states [batch, seq, embed] of whole sequences.

        tokens: int32[batch, seq]; positions: int32[batch, seq] (default 0..seq-1);
        segment_ids: int32[batch, seq], tokens attend only within their segment (0 = padding).
        """
        batch, seq = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))[None]
        if segment_ids is not None:
            same = segment_ids[:, :, None] == segment_ids[:, None, :]
            mask = causal & same & (segment_ids[:, None, :] != 0)
        else:
            mask = jnp.broadcast_to(causal, (batch, seq, seq))
        inv_freq = rope_inv_freq(self.config)
        x = self._embed(tokens)
        for layer in self.layers:
            x = self._layer(
                layer, x, positions, inv_freq, lambda q, k, v: grouped_attention(q, k, v, mask)
            )
        return self.final_norm(x)

    def forward_train(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        return_logits: bool = False,
        temperature: float = 1.0,
        options: ForwardOptions = REFERENCE,
    ) -> TrainOutput:
        """Per-token log-probs of `targets` (int32[batch, seq], usually tokens shifted left).

        temperature: a static float > 0; the log-probs (and the logits returned) are those
        of softmax(logits / temperature), the distribution an inference sampler at that
        temperature draws from. At 1 no division is made (the graph is the plain one).
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        h = self.hidden_states(
            tokens, positions=positions, segment_ids=segment_ids, options=options
        )
        logits = self._logits(h)
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = token_logprobs(logits, targets)
        values = self._values(h) if self.config.value_head else None
        return TrainOutput(logprobs, logits if return_logits else None, values)

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        cache: KVCache,
        *,
        logits_index: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Inference forward of new tokens through a KV cache (prefill or decode step).

        tokens, positions: int32[batch, new]; valid: bool[batch, new].
        logits_index: int32[batch] picks one position per row (e.g. the last prompt
        token): returns float32[batch, vocab] instead of float32[batch, new, vocab].
        """
        inv_freq = rope_inv_freq(self.config)
        x = self._embed(tokens)
        for i, layer in enumerate(self.layers):

            def attend(q, k, v, i=i):
                nonlocal cache
                out, cache = cache.attend(i, q, k, v, positions, valid)
                return out

            x = self._layer(layer, x, positions, inv_freq, attend)
        h = self.final_norm(x)
        if logits_index is not None:
            h = jnp.take_along_axis(h, logits_index[:, None, None], axis=1)
            return self._logits(h)[:, 0], cache
        return self._logits(h), cache


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[targets].

    logits: float[batch, seq, vocab]; targets: int32[batch, seq] -> float32[batch, seq].
    """
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def param_logical_axes(config: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """{"layers/0/attn/wq": ("embed", "heads", "head_dim"), ...}: the logical axes of every
    parameter, keyed by the tree path of `rlax_tpu.tree.flatten`; nothing is allocated."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    paths = flatten(nnx.to_pure_dict(state))  # same leaf order as `variables`
    return dict(zip(paths, [tuple(v.logical_axes) for v in variables], strict=True))
