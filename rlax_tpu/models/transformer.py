"""The decoder-only transformer family: Llama 3 (incl. its RoPE scaling), Qwen2 (qkv
bias) and Qwen3 (q/k RMSNorm), in Flax NNX.

Parameters carry logical axis names (see rlax_tpu.sharding); activations are
constrained by name. Two entry points: `forward_train` over whole sequences (per-token
log-probs of given targets) and `decode` through a KV cache (rlax_tpu.models.kv_cache).
Norms, softmax and logits are float32; matmuls run in `config.dtype`. The projections read
their weights through `quantization.weight`: a served model may hold them quantized (int8 or
fp8 with per-channel scales, rlax_tpu.models.quantization), dequantized in the matmul.

Memory of the training forward is chosen by `ForwardOptions` (rlax_tpu.models.options):
each decoder layer under `jax.checkpoint` with a remat policy, and the attention backend
(rlax_tpu.models.attention). `Transformer(..., scan_layers=True)` stacks the decoder
layers' parameters on a leading "layers" axis and runs them with one `lax.scan`; the
per-layer tree (`layers/0/...`) is the exchange format (`unstack_layers`, `stack_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from rlax_tpu.config import ModelConfig
from rlax_tpu.models import lora as lora_lib
from rlax_tpu.models import quantization
from rlax_tpu.models.attention import train_attention
from rlax_tpu.models.kv_cache import KVCache
from rlax_tpu.models.logprobs import (
    LogprobFormula,
    head_from_logits,
    logprob_head,
    token_logprobs,  # noqa: F401 (re-exported: rlax_tpu.models.token_logprobs)
    unembed,
)
from rlax_tpu.models.options import REFERENCE, ForwardOptions
from rlax_tpu.sharding import constrain
from rlax_tpu.tree import flatten

_INIT_STD = 0.02  # Hugging Face's default initializer_range

_save = jax.checkpoint_policies.save_only_these_names
# What a decoder layer keeps for the backward pass (TrainerConfig.remat_policy; MaxText's
# names). None: no jax.checkpoint at all, everything the backward needs is kept. "full":
# only the layer's input; the layer is recomputed in the backward. The others also keep
# the matmul outputs named in Attention / MLP (checkpoint_name) or, "minimal", every matmul
# without dot batch dimensions (the projections, not the attention scores).
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": _save("query_proj", "key_proj", "value_proj"),
    "save_out_proj": _save("out_proj"),
    "save_dot_except_mlp": _save("query_proj", "key_proj", "value_proj", "out_proj"),
}


def _lora_scale(config: ModelConfig) -> float:
    return config.lora.scale if config.lora is not None else 0.0


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
        scale = _lora_scale(self.config)
        q = jnp.einsum("bse,ehd->bshd", x, quantization.weight(self, "wq", dt))
        k = jnp.einsum("bse,ehd->bshd", x, quantization.weight(self, "wk", dt))
        v = jnp.einsum("bse,ehd->bshd", x, quantization.weight(self, "wv", dt))
        q = lora_lib.adapted(self, "wq", x, q, scale)
        k = lora_lib.adapted(self, "wk", x, k, scale)
        v = lora_lib.adapted(self, "wv", x, v, scale)
        q = checkpoint_name(q, "query_proj")
        k = checkpoint_name(k, "key_proj")
        v = checkpoint_name(v, "value_proj")
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
        y = jnp.einsum("bshd,hde->bse", attn, quantization.weight(self, "wo", attn.dtype))
        y = lora_lib.adapted(self, "wo", attn, y, _lora_scale(self.config))
        return constrain(checkpoint_name(y, "out_proj"), ("batch", "length", "act_embed"))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, _dtype(config.param_dtype)
        self.lora_scale = _lora_scale(c)
        self.w_gate = _param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pd)
        self.w_up = _param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pd)
        self.w_down = _param(rngs, (c.intermediate_size, c.hidden_size), ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        gate = jnp.einsum("bse,em->bsm", x, quantization.weight(self, "w_gate", dt))
        up = jnp.einsum("bse,em->bsm", x, quantization.weight(self, "w_up", dt))
        gate = lora_lib.adapted(self, "w_gate", x, gate, self.lora_scale)
        up = lora_lib.adapted(self, "w_up", x, up, self.lora_scale)
        gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        y = jnp.einsum("bsm,me->bse", h, quantization.weight(self, "w_down", dt))
        y = lora_lib.adapted(self, "w_down", h, y, self.lora_scale)
        return constrain(checkpoint_name(y, "mlp_down"), ("batch", "length", "act_embed"))


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
    entropies: jax.Array | None = None  # float32[batch, seq] of π, when asked for


def _stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer whose parameters are those of `layers` stacked on a leading axis
    (logical axis "layers", replicated by the default rules)."""
    graphdef, _ = nnx.split(layers[0])
    states = [nnx.split(layer)[1] for layer in layers]
    stacked = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    for _, variable in nnx.iter_graph(stacked):
        if isinstance(variable, nnx.Param):
            variable.set_metadata(logical_axes=("layers", *variable.logical_axes))
    return stacked


class Transformer(nnx.Module):
    """Llama 3 / Qwen2 / Qwen3 decoder. Build with `Transformer(config, rngs=nnx.Rngs(seed))`.

    scan_layers: the decoder layers' parameters stacked ([num_layers, ...], params tree
    `layers/attn/wq`) and run by one scan; the same seed gives the same values as the
    per-layer model (`layers/0/attn/wq`, ...), only stacked.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, scan_layers: bool = False):
        c, pd = config, _dtype(config.param_dtype)
        self.config = c
        self.scan_layers = scan_layers
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), pd)
        layers = [DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)]
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, pd, rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), pd)
        if c.value_head:
            self.value_w = _param(rngs, (c.hidden_size,), ("embed",), pd, "zeros")
            self.value_b = _param(rngs, (), (), pd, "zeros")
        if c.lora is not None:
            # Drawn after every base parameter: the base is the one the model has without LoRA.
            for layer in layers:
                lora_lib.add_adapters(layer, c.lora, rngs)
        self.layers = _stack_layers(layers) if scan_layers else nnx.List(layers)

    # -- pieces ---------------------------------------------------------------------
    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed.get_value(), tokens, axis=0).astype(_dtype(self.config.dtype))
        # The gather comes out sharded like the table (embed over fsdp); gathering it whole
        # first makes the move to batch sharding a local slice (and says so to XLA).
        x = constrain(x, (None, None, None))
        return constrain(x, ("batch", "length", "act_embed"))

    def _logits(self, h: jax.Array) -> jax.Array:
        """h: [b, s, embed] (final-normed) -> float32[b, s, vocab]."""
        tied = self.config.tie_word_embeddings
        return unembed(h, (self.embed if tied else self.lm_head).get_value(), tied=tied)

    def _values(self, h: jax.Array) -> jax.Array:
        w = self.value_w.get_value().astype(jnp.float32)
        return jnp.einsum("bse,e->bs", h.astype(jnp.float32), w) + self.value_b.get_value()

    def _layer(self, layer: DecoderLayer, x, positions, inv_freq, attend):
        q, k, v = layer.attn.qkv(layer.attn_norm(x), positions, inv_freq)
        x = x + layer.attn.out(attend(q, k, v))
        return x + layer.mlp(layer.mlp_norm(x))

    def _layer_modules(self) -> Iterator[DecoderLayer]:
        """The decoder layers one by one (slices of the stacked parameters when scanned)."""
        if not self.scan_layers:
            yield from self.layers
            return
        graphdef, stacked = nnx.split(self.layers)
        for i in range(self.config.num_layers):
            yield nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))

    def _run_layers(self, x: jax.Array, apply: Callable, remat_policy: str) -> jax.Array:
        """x through every decoder layer, `apply(layer, x) -> x`, each layer under
        jax.checkpoint with `remat_policy` (unless "none"); a scan when scan_layers."""
        if remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy {remat_policy!r} is not one of {sorted(REMAT_POLICIES)}"
            )
        policy = REMAT_POLICIES[remat_policy]
        layers = self.layers if self.scan_layers else list(self.layers)
        graphdef = nnx.split(layers if self.scan_layers else layers[0])[0]

        def block(state, x):
            return apply(nnx.merge(graphdef, state), x)

        if remat_policy != "none":
            # Inside a scan CSE cannot merge the recompute into the forward: no barrier needed.
            block = jax.checkpoint(block, policy=policy, prevent_cse=not self.scan_layers)
        if self.scan_layers:
            x, _ = jax.lax.scan(lambda x, state: (block(state, x), None), x, nnx.state(layers))
            return x
        for layer in layers:
            x = block(nnx.state(layer), x)
        return x

    # -- entry points -----------------------------------------------------------------
    def hidden_states(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        prefix_ids: jax.Array | None = None,
        options: ForwardOptions = REFERENCE,
    ) -> jax.Array:
        """Final-normed hidden states [batch, seq, embed] of whole sequences.

        tokens: int32[batch, seq]; positions: int32[batch, seq] (default 0..seq-1);
        segment_ids: int32[batch, seq], tokens attend only within their segment (0 = padding);
        prefix_ids: int32[batch, seq], and to the segment it names (a shared prompt; 0 = none).
        """
        batch, seq = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        inv_freq = rope_inv_freq(self.config)
        attention = train_attention(options.attention)

        def apply(layer, x):
            attend = lambda q, k, v: attention(q, k, v, segment_ids, prefix_ids)  # noqa: E731
            return self._layer(layer, x, positions, inv_freq, attend)

        x = self._run_layers(self._embed(tokens), apply, options.remat_policy)
        return self.final_norm(x)

    def forward_train(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        prefix_ids: jax.Array | None = None,
        return_logits: bool = False,
        return_entropy: bool = False,
        logprob_formula: LogprobFormula = "policy",
        temperature: float = 1.0,
        options: ForwardOptions = REFERENCE,
    ) -> TrainOutput:
        """Per-token log-probs of `targets` (int32[batch, seq], usually tokens shifted left).

        temperature: a static float > 0; the log-probs, entropies (and the logits returned)
        are those of softmax(logits / temperature), the distribution an inference sampler
        at that temperature draws from. At 1 no division is made (the graph is the plain one).
        logprob_formula: "policy" (logits[target] − logsumexp, the training forward's) or
        "inference" (log_softmax then the target's entry, the sampler's; the recompute's).
        return_entropy: also the entropies of π (`TrainOutput.entropies`).
        The log-prob head runs `options.logprob_chunk_size` tokens at a time
        (rlax_tpu.models.logprobs); return_logits=True materialises the whole logits and so
        always runs it unchunked.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        h = self.hidden_states(
            tokens,
            positions=positions,
            segment_ids=segment_ids,
            prefix_ids=prefix_ids,
            options=options,
        )
        values = self._values(h) if self.config.value_head else None
        if return_logits:
            logits = self._logits(h)
            if temperature != 1.0:
                logits = logits / temperature
            head = head_from_logits(
                logits, targets, formula=logprob_formula, entropy=return_entropy
            )
            return TrainOutput(head.logprobs, logits, values, head.entropies)
        tied = self.config.tie_word_embeddings
        head = logprob_head(
            h,
            (self.embed if tied else self.lm_head).get_value(),
            targets,
            tied=tied,
            temperature=temperature,
            formula=logprob_formula,
            entropy=return_entropy,
            chunk_size=options.logprob_chunk_size,
        )
        return TrainOutput(head.logprobs, None, values, head.entropies)

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
        for i, layer in enumerate(self._layer_modules()):

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


def param_logical_axes(config: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """{"layers/0/attn/wq": ("embed", "heads", "head_dim"), ...}: the logical axes of every
    parameter, keyed by the tree path of `rlax_tpu.tree.flatten`; nothing is allocated."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    paths = flatten(nnx.to_pure_dict(state))  # same leaf order as `variables`
    return dict(zip(paths, [tuple(v.logical_axes) for v in variables], strict=True))


# -- the per-layer exchange format -----------------------------------------------------------


def is_stacked(params: Mapping[str, Any]) -> bool:
    """Whether a params tree holds scanned (stacked) decoder layers: `layers/attn/...`
    rather than `layers/0/attn/...`."""
    layers = params.get("layers", {})
    return bool(layers) and not any(isinstance(k, int) or str(k).isdigit() for k in layers)


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """A params tree with per-layer decoder layers (`layers/0/...`), the format published,
    served and exported; a per-layer tree is returned as it is. Works on device arrays
    (slices keep their sharding) as on host arrays."""
    if not is_stacked(params):
        return dict(params)
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    layers = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(num_layers)}
    return {**params, "layers": layers}


def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `unstack_layers`: per-layer decoder layers stacked on a leading axis
    in layer order (a stacked tree is returned as it is)."""
    if is_stacked(params):
        return dict(params)
    layers = params["layers"]
    ordered = [layers[k] for k in sorted(layers, key=int)]
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *ordered)}
