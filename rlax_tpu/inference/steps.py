"""The jitted steps of the inference engine: prefill (a batch of prompts of one bucket, their
first tokens sampled), extend (tokens fed after the positions a row's pages hold, the next
token sampled), decode (`num_steps` tokens of the live slots) and the page copies of a
swap, with the static key that names the model and mesh they run. Pure functions of
(weights, cache, host arrays): the scheduler (scheduler.py) decides, these compute.
`StepPrograms` runs them for one engine: on its mesh, with saved executables in their place
where loaded, counting first calls (compiles), and lowers them on abstract arguments."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu.inference.page_allocator import PADDING_PAGE
from rlax_tpu.inference.paged_cache import PagedKVCache
from rlax_tpu.inference.sampling import sample_tokens
from rlax_tpu.models import Transformer
from rlax_tpu.sharding import constrain, use_mesh

# A jitted step as `rlax-tpu compile` lowers it: (the jitted function, its abstract arguments,
# the static argnums).
Lowering = tuple[Any, tuple, tuple[int, ...]]


class StaticKey:
    """The static part of a jitted step (model graphdef, state treedef, mesh): hashed once,
    compared by identity.

    jit hashes static arguments on every call, and hashing an nnx GraphDef walks the whole
    module graph (~0.6 ms for a 4-layer model). Interning makes engines of the same model
    and mesh share one key, hence one compilation cache entry.
    """

    _interned: dict = {}

    def __init__(self, graphdef: nnx.GraphDef, treedef: Any, mesh_key: Any):
        self.graphdef, self.treedef, self.mesh_key = graphdef, treedef, mesh_key

    @classmethod
    def of(cls, graphdef: nnx.GraphDef, treedef: Any, mesh_key: Any) -> StaticKey:
        key = (graphdef, treedef, mesh_key)
        return cls._interned.setdefault(key, cls(*key))

    def model(self, params: list[jax.Array]) -> Transformer:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def prefill_step(
    static,
    params,
    cache,
    logits_table,
    rows,
    tokens,
    lengths,
    logit_rows,
    source,
    starts,
    key_data,
    temperature,
    top_k,
    top_p,
    lp,
    blocks,
    copy_src,
    copy_dst,
):
    """Prefill a batch of prompts, then sample the next response token of every sample of
    them (t = starts) and copy the pages of samples that share a prompt.

    Model rows (the prompts, one per distinct context): rows: int32[batch, pages_per_seq],
    each prompt's page-table row; tokens: int32[batch, bucket] (right-padded: the prompt,
    then a continuation's response so far); lengths: int32[batch] their lengths (0 = a
    padding row: it writes nothing and its output is garbage); logit_rows: int32[batch],
    the row of `logits_table` (float32[entries, vocab], the prefix cache's) each prompt's
    last logits are kept in (entries: not kept).
    Sample rows (`sample_rows` = a multiple of batch): source: int32[sample_rows], the model
    row whose last logits each samples from; starts: the response index t of the token
    sampled (0 for a fresh prompt, the tokens so far for a continuation); key_data:
    uint32[sample_rows, 2]; temperature, top_p: float32; top_k: int32; lp: bool ("sampled"
    log-probs). They are sampled `batch` rows at a time, the first `blocks` (int32[]) blocks
    only: each block is the sampler's call on a prefill's batch, so a sample's token and
    log-prob do not depend on the rows it shares its prompt with.
    copy_src, copy_dst: int32[n] pages copied after the prompts are written (a sharing
    sample's, or the prefix cache's, own copy of its prompt's last, partial page; a copy of
    the padding page onto itself is padding).
    Returns (packed int32[2, sample_rows]: tokens and log-probs as float32 bits, so the host
    fetches them in one transfer; cache with the prompts' keys/values written; the logits
    table).
    """
    model = static.model(params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    table = cache.page_table
    logits, cache = model.decode(
        tokens,
        positions,
        positions < lengths[:, None],
        cache.for_prefill(rows),
        logits_index=jnp.maximum(lengths - 1, 0),
    )
    logits = logits.astype(jnp.float32)
    # Replicated, as the engine places it: a call's output is the next call's input.
    logits_table = constrain(logits_table.at[logit_rows].set(logits, mode="drop"), (None, None))
    sampling = (source, starts, key_data, temperature, top_k, top_p, lp)
    packed = sample_blocks(logits, sampling, blocks, tokens.shape[0])
    return packed, copy_pages(cache, copy_src, copy_dst).with_page_table(table), logits_table


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def sample_step(block, cache, logits_table, sampling, blocks, copy_src, copy_dst):
    """The first tokens of samples whose prompt the prefix cache holds: as `prefill_step`'s
    sample rows, `source` a row of `logits_table` (float32[entries, vocab], filled by the
    prefill that computed the prompt), sampled `block` (prefill_rows) rows at a time; and
    each one's copy of its prompt's partial last page (from the cache's copy). Returns
    (packed int32[2, sample_rows], cache)."""
    packed = sample_blocks(logits_table, sampling, blocks, block)
    return packed, copy_pages(cache, copy_src, copy_dst)


def sample_blocks(logits, sampling, blocks, block):
    """Sample rows (source, starts, key_data, temperature, top_k, top_p, lp: each
    [sample_rows]) from `logits[source]`, `block` rows at a time, the first `blocks` blocks:
    int32[2, sample_rows] (tokens, log-prob bits; zeros past the blocks)."""
    source = sampling[0]

    def sample_block(b, packed):
        def take(x):
            return jax.lax.dynamic_slice_in_dim(x, b * block, block)

        _, starts, key_data, *params = (take(x) for x in sampling)
        token, logprob = sample_tokens(logits[take(source)], key_data, starts, *params)
        out = jnp.stack([token, jax.lax.bitcast_convert_type(logprob, jnp.int32)])
        return jax.lax.dynamic_update_slice_in_dim(packed, out, b * block, axis=1)

    return jax.lax.fori_loop(0, blocks, sample_block, jnp.zeros((2, source.shape[0]), jnp.int32))


def copy_pages(cache, src, dst):
    """`cache` with pages `src` (int32[n]) copied to pages `dst` in every layer; a dst out of
    range (num_pages: padding) is dropped."""

    def copy(pool):
        return pool.at[:, dst].set(pool[:, src], mode="drop")

    return cache.replace(
        keys=tuple(copy(k) for k in cache.keys), values=tuple(copy(v) for v in cache.values)
    )


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def extend_step(
    static,
    params,
    cache,
    rows,
    tokens,
    lengths,
    offsets,
    starts,
    key_data,
    temperature,
    top_k,
    top_p,
    lp,
):
    """Feed tokens after the positions each row's pages already hold, and sample the next
    response token (t = starts): a continuation's tokens after its parked pages (an
    episode's turn-ending token and the observation after it).

    As `prefill_step`, with offsets: int32[batch], the position of each row's first token
    (the positions its pages hold). The tokens are written to the pages and attend the
    pages' keys and values and each other causally (`paged_attention` of several tokens).
    """
    model = static.model(params)
    steps = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = offsets[:, None] + steps[None, :]
    table = cache.page_table
    logits, cache = model.decode(
        tokens,
        positions,
        steps[None, :] < lengths[:, None],
        cache.with_page_table(rows),
        logits_index=jnp.maximum(lengths - 1, 0),
    )
    token, logprob = sample_tokens(logits, key_data, starts, temperature, top_k, top_p, lp)
    packed = jnp.stack([token, jax.lax.bitcast_convert_type(logprob, jnp.int32)])
    return packed, cache.with_page_table(table)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_step(static, num_steps, params, cache, carry, sampling, live):
    """`num_steps` decode steps of the slots `live`, sampling on device.

    carry: (last token, position, response index t of the next token: int32[slots],
    active: bool[slots]); sampling: `scheduler.SlotArrays.sampling` (per-slot key data,
    temperature, top_k, top_p, "sampled" flag, response limit, stop ids int32[slots,
    max_stop_tokens]);
    live: int32[rows], the slot of each row (`slots` = a padding row: inactive, no page).
    The rows' state is gathered from the slots', stepped, and written back. A slot stops
    (active = False, no more cache writes) at a stop token or its limit. Returns (cache,
    carry, out: int32[3, steps, rows]): out packs the sampled tokens, their log-probs
    (float32 bits) and whether each was emitted (1) or the row was idle (0), so the host
    fetches them in one transfer.
    """
    model = static.model(params)
    slots = carry[0].shape[0]
    present = live < slots
    index_of = jnp.where(present, live, 0)
    tokens, positions, index, active = (x[index_of] for x in carry)
    active = active & present
    key_data, temperature, top_k, top_p, lp, limit, stop_ids = (x[index_of] for x in sampling)
    table = cache.page_table
    rows_table = jnp.where(present[:, None], table[index_of], PADDING_PAGE)

    def one_step(c, _):
        cache, tokens, positions, index, active = c
        logits, cache = model.decode(tokens[:, None], positions[:, None], active[:, None], cache)
        new, logprobs = sample_tokens(logits[:, 0], key_data, index, temperature, top_k, top_p, lp)
        emitted = active
        index = index + emitted
        stopped = jnp.any(new[:, None] == stop_ids, axis=-1)
        active = active & ~stopped & (index < limit)
        tokens = jnp.where(emitted, new, tokens)
        positions = positions + emitted
        return (cache, tokens, positions, index, active), (new, logprobs, emitted)

    (cache, *rows), (tokens, logprobs, emitted) = jax.lax.scan(
        one_step,
        (cache.with_page_table(rows_table), tokens, positions, index, active),
        length=num_steps,
    )
    back = jnp.where(present, live, slots)  # padding rows write out of range: dropped
    carry = tuple(x.at[back].set(r, mode="drop") for x, r in zip(carry, rows, strict=True))
    logprob_bits = jax.lax.bitcast_convert_type(logprobs, jnp.int32)
    out = jnp.stack([tokens, logprob_bits, emitted.astype(jnp.int32)])
    return cache.with_page_table(table), carry, out


@jax.jit
def read_pages(cache, pages):
    """Keys and values of `pages` (int32[n]) in every layer: per layer [kv_heads, n,
    page_size, head_dim]."""
    return tuple(k[:, pages] for k in cache.keys), tuple(v[:, pages] for v in cache.values)


@functools.partial(jax.jit, donate_argnums=(0,))
def write_pages(cache, pages, keys, values):
    """`cache` with `keys` / `values` (as `StepPrograms.read_pages` returns) written into
    `pages`; an out-of-range page (padding) is dropped."""

    def write(pool, new):
        return pool.at[:, pages].set(new.astype(pool.dtype), mode="drop")

    return cache.replace(
        keys=tuple(write(k, x) for k, x in zip(cache.keys, keys, strict=True)),
        values=tuple(write(v, x) for v, x in zip(cache.values, values, strict=True)),
    )


def pow2(n: int) -> int:
    """The smallest power of two >= n (swap copies compile once per such size)."""
    return 1 << max(0, n - 1).bit_length()


class StepPrograms:
    """The jitted steps as one engine runs them: on its mesh (none: the default device), with
    host arguments placed replicated, a saved executable in place of a step where
    `use_saved_executables` loaded one, and the first call of each shape counted as its
    compile. Also lowers each step on abstract arguments (`rlax-tpu compile`).

    `static` names the model and mesh (`StaticKey`); `abstract_cache` is the KV cache's
    layout; `progress` hears of each compile and how long it took."""

    def __init__(
        self,
        static: StaticKey,
        abstract_cache: PagedKVCache,
        mesh: Mesh | None,
        rules: Any,
        *,
        prefill_rows: int,
        decode_steps_per_call: int,
        progress: Callable[[str], None] | None = None,
    ):
        self.static, self.abstract_cache = static, abstract_cache
        self.mesh, self.rules, self.progress = mesh, rules, progress
        self.prefill_rows, self.decode_steps_per_call = prefill_rows, decode_steps_per_call
        self.programs: dict[str, Any] = {}  # saved executables, by program key
        self.shapes: set[str] = set()  # jitted signatures used: "prefill:<rows>x<bucket>", ...
        # Seconds spent in first calls (compiles) so far, and when the one running began:
        # the worker's status reports them, so a watched call's deadline leaves them out.
        self._compile_s = 0.0
        self._compiling_since: float | None = None

    # -- running ---------------------------------------------------------------------------
    def prefill(
        self,
        bucket: int,
        params: list,
        cache: PagedKVCache,
        logits_table: jax.Array,
        args: tuple[np.ndarray, ...],
    ) -> tuple[jax.Array, PagedKVCache, jax.Array]:
        """Dispatch one prefill call (`args`: `scheduler.prefill_args`); returns its packed
        int32[2, sample_rows] (first tokens, log-prob bits), still on the device, the cache
        and the prefix cache's logits table."""
        what = f"prefill for {self.prefill_rows}x{bucket} prompt tokens"
        return self._first_tokens(
            "prefill", prefill_step, bucket, what, params, (cache, logits_table), args
        )

    def sample(
        self, cache: PagedKVCache, logits_table: jax.Array, args: tuple[np.ndarray, ...]
    ) -> tuple[jax.Array, PagedKVCache]:
        """Dispatch one sample call (`sample_step`; `args`: `scheduler.sample_args`): the
        first tokens of samples of prompts the prefix cache holds."""
        sampling, rest = args[:7], args[7:]
        rows = len(sampling[0])
        step = self.programs.get(f"sample@{rows}", sample_step)
        first = None
        if step is sample_step:
            first = self._first_call(f"sample:{rows}", f"sampling of {rows} prefix-cache rows")
        with self.mesh_context():
            packed, cache = step(
                self.prefill_rows, cache, logits_table, self.put(sampling), *self.put(rest)
            )
        if first is not None:
            seconds = first()
            if self.progress is not None:
                self.progress(f"sampling of {rows} prefix-cache rows: compiled in {seconds:.1f}s")
        return packed, cache

    def extend(
        self, bucket: int, params: list, cache: PagedKVCache, args: tuple[np.ndarray, ...]
    ) -> tuple[jax.Array, PagedKVCache]:
        """Dispatch one extend call (`args`: `scheduler.prefill_args(..., extend=True)`);
        returns its packed int32[2, prefill_rows], still on the device, and the cache."""
        what = f"extend for {self.prefill_rows}x{bucket} tokens after cached pages"
        return self._first_tokens("extend", extend_step, bucket, what, params, (cache,), args)

    def _first_tokens(
        self,
        name: str,
        jitted: Any,
        bucket: int,
        what: str,
        params: list,
        donated: tuple,
        args: tuple,
    ) -> tuple:
        """One call of a step that samples each row's next token (prefill, extend), on the
        `donated` device state (the cache, and the logits table for prefill): (packed,
        *donated)."""
        step = self.programs.get(f"{name}@{bucket}", jitted)
        first = None
        if step is jitted:
            first = self._first_call(f"{name}:{self.prefill_rows}x{bucket}", what)
        with self.mesh_context():
            out = step(self.static, params, *donated, *self.put(args))
        if first is not None:  # the call returns once compiled; it runs asynchronously
            seconds = first()
            if self.progress is not None:
                self.progress(f"{what}: compiled in {seconds:.1f}s")
        return out

    def decode(
        self, params: list, cache: PagedKVCache, carry: Any, sampling: Any, live: jax.Array
    ) -> tuple[PagedKVCache, Any, np.ndarray]:
        """One decode call of the slots `live` (`decode_step`); returns the cache, the carry
        and its output on the host (the one device-to-host transfer of the call)."""
        rows, k = live.shape[0], self.decode_steps_per_call
        what = f"decode for {rows} slots, {k} steps a call"
        step = self.programs.get(f"decode@{rows}", decode_step)
        first = None if step is not decode_step else self._first_call(f"decode:{rows}x{k}", what)
        with self.mesh_context():
            cache, carry, out = step(self.static, k, params, cache, carry, sampling, live)
        packed = np.asarray(out)
        if first is not None:
            seconds = first()
            if self.progress is not None:
                self.progress(f"{what}: compiled and ran in {seconds:.1f}s")
        return cache, carry, packed

    def read_pages(self, cache: PagedKVCache, pages: list[int]) -> tuple[tuple, tuple]:
        """The keys and values of `pages` (every layer) copied to the host: per layer
        [kv_heads, len(pages), page_size, head_dim]."""
        index = np.zeros(pow2(len(pages)), np.int32)  # padded with the padding page
        index[: len(pages)] = pages
        with self.mesh_context():
            read = self.programs.get(f"swap_out@{len(index)}", read_pages)
            keys, values = jax.device_get(read(cache, self.put(index)))
        n = len(pages)
        return tuple(k[:, :n].copy() for k in keys), tuple(v[:, :n].copy() for v in values)

    def write_pages(self, cache: PagedKVCache, pages: list[int], data: Any) -> PagedKVCache:
        """`cache` with a swapped-out sequence's keys and values (`read_pages`) in `pages`."""
        n, size = len(pages), pow2(len(pages))
        index = np.full(size, cache.num_pages, np.int32)  # padding: dropped
        index[:n] = pages

        def padded(x: np.ndarray) -> np.ndarray:
            out = np.zeros((x.shape[0], size, *x.shape[2:]), x.dtype)
            out[:, :n] = x
            return out

        keys, values = (tuple(padded(x) for x in part) for part in data)
        # Each device receives only its own kv heads of the pages, as the pool holds them.
        pool = self.abstract_cache.keys[0].sharding
        keys, values = jax.device_put((keys, values), pool)
        with self.mesh_context():
            write = self.programs.get(f"swap_in@{size}", write_pages)
            return write(cache, self.put(index), keys, values)

    def put(self, tree: Any) -> Any:
        """Host arrays to the device (replicated over the mesh, if any). Copied first: on
        CPU a device array may alias the numpy buffer, and the host mirrors change."""
        tree = jax.tree.map(np.array, tree)
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def mesh_context(self) -> contextlib.AbstractContextManager:
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_mesh(self.mesh, self.rules)

    # -- compile accounting ----------------------------------------------------------------
    def _first_call(self, shape: str, what: str) -> Callable[[], float] | None:
        """Record `shape` ("decode:<rows>x<steps>") as used. The first time, say that `what`
        compiles (with a `progress` to tell) and return a clock of the seconds since;
        reading it ends the compile's count in `compile_seconds`."""
        if shape in self.shapes:
            return None
        self.shapes.add(shape)
        if self.progress is not None:
            self.progress(f"compiling the {what} ...")
        t0 = self._compiling_since = time.monotonic()

        def done() -> float:
            seconds = time.monotonic() - t0
            if self._compiling_since == t0:
                self._compile_s += seconds
                self._compiling_since = None
            return seconds

        return done

    def compile_seconds(self) -> float:
        """Seconds spent compiling so far, a compile in progress included (any thread may
        ask: two plain reads)."""
        since = self._compiling_since
        return self._compile_s + (time.monotonic() - since if since is not None else 0.0)

    def compiling_seconds(self) -> float:
        """Seconds the compile running now has taken (0.0 when none runs)."""
        since = self._compiling_since
        return time.monotonic() - since if since is not None else 0.0

    # -- lowering without hardware (rlax-tpu compile) and saved executables ----------------
    # Each program is lowered on abstract weights, cache and host arguments (the host arrays
    # the engine passes, as `put` places them): what `rlax-tpu compile` lowers, what
    # `--save-compiled` saves under the program's key ("prefill@128", "extend@128",
    # "decode@64", "swap_out@8", "swap_in@8"), and what a worker with
    # `inference.compiled_dir` loads in place of compiling.
    def _abstract_host(self, tree: Any) -> Any:
        """Host arrays as `put` would place them (replicated), abstract."""
        sharding = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding),
            tree,
        )

    def prefill_lowering(
        self, params: list, logits_table: Any, args: tuple[np.ndarray, ...]
    ) -> Lowering:
        """The prefill step on `params` and the logits table (abstract) and host `args` of one
        bucket."""
        args = self._abstract_host(args)
        return (
            prefill_step,
            (self.static, params, self.abstract_cache, logits_table, *args),
            (0,),
        )

    def sample_lowering(self, logits_table: Any, args: tuple[np.ndarray, ...]) -> Lowering:
        """The sample step (prefix-cache hits) on the logits table (abstract) and host
        `args` (`scheduler.sample_args`)."""
        sampling, rest = self._abstract_host(args[:7]), self._abstract_host(args[7:])
        return (
            sample_step,
            (self.prefill_rows, self.abstract_cache, logits_table, sampling, *rest),
            (0,),
        )

    def extend_lowering(self, params: list, args: tuple[np.ndarray, ...]) -> Lowering:
        """The extend step on `params` (abstract) and host `args` of one bucket."""
        args = self._abstract_host(args)
        return extend_step, (self.static, params, self.abstract_cache, *args), (0,)

    def decode_lowering(self, params: list, carry: tuple, sampling: tuple, rows: int) -> Lowering:
        """The decode step of `rows` live slots for `decode_steps_per_call` tokens."""
        args = (
            self.static,
            self.decode_steps_per_call,
            params,
            self.abstract_cache,
            self._abstract_host(carry),
            self._abstract_host(sampling),
            self._abstract_host(np.zeros(rows, np.int32)),
        )
        return decode_step, args, (0, 1)

    def swap_out_lowering(self, pages: int) -> Lowering:
        """The copy of `pages` pages out of the pool (`read_pages`: what a swap-out runs
        before its device-to-host transfer)."""
        index = self._abstract_host(np.zeros(pages, np.int32))
        return read_pages, (self.abstract_cache, index), ()

    def swap_in_lowering(self, pages: int) -> Lowering:
        """The write of `pages` swapped pages back into the pool (`write_pages`, the pool
        donated)."""
        cache = self.abstract_cache
        pool = cache.keys[0]

        def page_block(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(
                (x.shape[0], pages, *x.shape[2:]), x.dtype, sharding=pool.sharding
            )

        keys = tuple(page_block(k) for k in cache.keys)
        values = tuple(page_block(v) for v in cache.values)
        index = self._abstract_host(np.zeros(pages, np.int32))
        return write_pages, (cache, index, keys, values), ()

    def lower(self, lowering: Lowering) -> jax.stages.Lowered:
        jitted, args, _ = lowering
        with self.mesh_context():
            return jitted.lower(*args)

    def use_saved_executables(self, directory: str, lowerings: dict[str, Lowering]) -> list[str]:
        """Run the executables `directory` holds in place of the `lowerings` of their keys;
        returns those keys. CompiledMismatchError when one was compiled for another program
        or mesh."""
        # rlax_tpu.compile lowers the engine's programs: imported here, not at the top, so
        # the inference package does not import it back.
        from rlax_tpu.compile import executables

        if self.mesh is None:
            raise executables.CompiledMismatchError(
                "saved executables are compiled for a mesh; this engine has none"
            )
        loaded = []
        saved = executables.saved_names(directory)
        for key, lowering in lowerings.items():
            if key not in saved:  # not compiled ahead (e.g. extend without episodes): not lowered
                continue
            executable = executables.load(directory, key, self.lower(lowering), self.mesh)
            if executable is not None:
                jitted, args, static = lowering
                self.programs[key] = executables.SavedProgram(executable, jitted, args, static)
                loaded.append(key)
        return loaded
