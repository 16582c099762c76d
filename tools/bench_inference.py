#!/usr/bin/env python3
"""Inference-engine throughput against static batching (and Tunix, when installed).

    python tools/bench_inference.py [--quick] [--json OUT] [--requests N] [--decode-steps K]
        [--kv-requests N] [--kv-repeats R] [--group-only] [--quantized-only]

One mixed-length workload (prompt and output lengths lognormal, fixed seed; each output
length is the request's max_new_tokens with no stop tokens, so every system generates
exactly the same tokens' worth of work) on a tiny model, run by: our continuous-batching
engine; a static-batch dense-cache JAX loop written here (batches of `slots` requests in
order, padded to the batch's longest prompt bucket, decoding until its longest output is
done); and Tunix's vanilla sampler when the `google-tunix` package is importable. Only
response tokens a request asked for count; every system is timed warm (compiled).

`group`: a GRPO batch of 64 samples, k in {4, 8, 16} samples of each 512-token prompt, 16-128
new tokens each, through an engine sharing each group's prompt prefill and KV pages
(inference.share_prompt_pages) and one prefilling every sample: tokens/s and the ratio
(`speedup_shared_prefix`, at k = 8), prompt tokens prefilled and their FLOPs per group, KV
pages per group at the peak, and whether the rollouts are bitwise equal (`--group-only`).

A second case resembles one RL batch: 8 prompts x 8 samples of ~45 tokens, 4-16 new
tokens each, all in flight at once (64 decode slots), so prefill weighs as much as decode.
It is timed per batch with one prompt per prefill call and with batched prefill, on the
inference mesh a rollout worker builds (`inference.mesh`: all devices, tensor-parallel; run
with XLA_FLAGS=--xla_force_host_platform_device_count=2 for the CPU demo's two devices).

`kv_budget`: KV pages on demand against pages reserved at admission. The same heavy-tailed
lengths (1024 requests) on engines of 256 decode slots (automatic decode buckets 64, 128,
256; --quick: 192 requests on 128 slots), sent as an RL rollout sends them: max_new_tokens
the config's cap and a stop token that ends each request at its drawn length (the token
its probe run, the request as drawn, ended with), so every engine generates the same
tokens but one that reserves pages reserves them for the cap. Three engines: today's
(kv_admission="reserve", one decode size: the baseline), reserve with decode buckets (the
decode sizes alone) and pages on demand (the defaults), at a KV budget of a quarter of the
slots' worst case (max_prompt_len + max_new_tokens each) and at one holding every slot's.
Each: tokens/s and its ratio to today's engine, live sequences per decode call,
preemptions and swap bytes per 1,000 tokens, and whether its rollouts equal today's
engine's (bitwise, as the engine promises); timed after a warm-up run of the same pools.

`quantized` (`--quantized-only`): the demo's model and the ~20M-parameter model of
tools/bench_e2e.py served bf16 (the baseline), int8 and fp8 (`inference.weight_dtype`: the
projections quantized by the engine at load) in one run: the served weights' bytes, the
load of a fresh version (quantization included), generation tokens/s of a decode-heavy
batch, each as a ratio against bf16, and the behaviour log-probs' mismatch against the
trainer's recompute from the unquantized weights.

`worker_load` times what a rollout worker pays per version of a small model (the tiny
default model, and this benchmark's model): `InferenceWorker.load` of a version just
published to a real parameter-server process (pull + swap into the engine), and the two
apart (the pull alone; the swap of already-pulled params), medians over many versions.

The served worker, as a run's controller drives it: a parameter-server process and an
`rlax-tpu serve inference` process on loopback, timed through `InferenceWorkerClient`. Its
Load of each version just published (`worker_load.*.served_load_s`: the RPC, the pull in
the worker process and the swap) and, on the tiny model, its Generate of the RL batch with
all rollouts streamed back (`served_generate`), next to the same batch through an engine
built here as the worker builds it (its config, its mesh, one decode step per call): the
difference is what one Generate call costs beyond the engine's work
(`served_generate.overhead_s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_param_server import start_param_server  # noqa: E402
from flax import nnx  # noqa: E402

from rlax_tpu.config import MeshConfig, ModelConfig, RunConfig  # noqa: E402
from rlax_tpu.hardware import host_cpu  # noqa: E402
from rlax_tpu.inference.engine import Engine, GenerationRequest  # noqa: E402
from rlax_tpu.inference.sampling import SamplingParams, request_key_data, sample_tokens  # noqa: E402
from rlax_tpu.models import DenseKVCache, Transformer  # noqa: E402
from rlax_tpu.param_server.trees import TreeClient  # noqa: E402
from rlax_tpu.simulator import workloads as bench_workload  # noqa: E402
from rlax_tpu.simulator.model import decode_flops_per_token  # noqa: E402
from rlax_tpu.trainer import perf  # noqa: E402

# The workload (model, engine config, lengths) is the simulator's calibration's too.
MODEL, INFERENCE, SEED = bench_workload.MODEL, bench_workload.INFERENCE, bench_workload.SEED
RL_INFERENCE = bench_workload.RL_INFERENCE
RL_PROMPTS, RL_SAMPLES = bench_workload.RL_PROMPTS, bench_workload.RL_SAMPLES


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[tuple[int, ...]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return int(sum(self.output_lens))


def make_workload(num_requests: int, seed: int = SEED) -> Workload:
    """Heavy-tailed lengths (rlax_tpu.simulator.workloads), then random prompt tokens."""
    rng = np.random.default_rng(seed)
    prompt_lens, output_lens = bench_workload.draw_lengths(rng, num_requests)
    prompts = [tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, n)) for n in prompt_lens]
    return Workload(prompts, output_lens)


def requests_for(workload: Workload) -> list[GenerationRequest]:
    base = SamplingParams.from_config(INFERENCE)
    return [
        GenerationRequest(
            f"r{i}", f"p{i}", 0, p, dataclasses.replace(base, max_new_tokens=n, stop_token_ids=())
        )
        for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
    ]


# -- our engine ---------------------------------------------------------------------------------
def engine_runner(params, workload: Workload, decode_steps: int):
    """A warm (compiled) engine and a function that runs the whole workload through it."""
    engine = Engine(MODEL, INFERENCE, seed=SEED, decode_steps_per_call=decode_steps)
    engine.load(0, params)
    requests = requests_for(workload)

    def run() -> None:
        rollouts = engine.run(requests)
        assert sum(len(r.tokens) for r in rollouts) == workload.useful_tokens

    run()  # warm-up: compiles every shape the workload uses
    return engine, run


def rl_batch_requests(
    seed: int = SEED, vocab_size: int = MODEL.vocab_size
) -> list[GenerationRequest]:
    """8 prompts x 8 samples: prompts of 38-52 tokens, 4-16 new tokens per sample (the same
    lengths for a model of another `vocab_size`, token ids folded into it)."""
    rng = np.random.default_rng(seed)
    base = SamplingParams.from_config(RL_INFERENCE)
    requests = []
    for p in range(RL_PROMPTS):
        ids = rng.integers(0, MODEL.vocab_size, int(rng.integers(38, 53))) % vocab_size
        tokens = tuple(int(t) for t in ids)
        for k in range(RL_SAMPLES):
            sampling = dataclasses.replace(base, max_new_tokens=int(rng.integers(4, 17)))
            requests.append(GenerationRequest(f"rl{p}.{k}", f"rl{p}", k, tokens, sampling))
    return requests


def inference_mesh():
    """The mesh a rollout worker builds from `inference.mesh` (data 1, fsdp 1, tensor -1:
    every device, tensor-parallel), as rlax_tpu/inference/server.py does."""
    from rlax_tpu.sharding import build_mesh

    return build_mesh(MeshConfig(data=1, fsdp=1, tensor=-1))


def rl_batch_runner(params, prefill_batch_size: int, decode_steps: int):
    """A warm engine with `prefill_batch_size` on the worker's mesh and a function that
    generates one RL batch through it."""
    # Each sample prefilled on its own: the simulator's calibration separates a prefill
    # call's cost from its tokens over these calls (a shared group is one row).
    config = dataclasses.replace(
        RL_INFERENCE, prefill_batch_size=prefill_batch_size, share_prompt_pages=False
    )
    engine = Engine(
        MODEL, config, seed=SEED, decode_steps_per_call=decode_steps, mesh=inference_mesh()
    )
    engine.load(0, params)
    requests = rl_batch_requests()

    def run() -> None:
        engine.run(requests)

    run()  # warm-up
    return engine, run


# -- a rollout worker's load of a version --------------------------------------------------------
LOAD_VERSIONS = 20  # versions published and loaded per model (medians)


def worker_load(model: ModelConfig, versions: int = LOAD_VERSIONS) -> dict:
    """Median `InferenceWorker.load` of a just-published version of `model` (pull from a
    parameter-server process + swap into the engine on the worker's mesh), and its parts."""
    from rlax_tpu.inference.worker import InferenceWorker

    token = secrets.token_hex(16)
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=token, JAX_PLATFORMS="cpu")
    params = nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(SEED)), nnx.Param))
    leaves = jax.tree.leaves(params)
    config = RunConfig(model=model, inference=RL_INFERENCE)
    loads, pulls, swaps = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        server, address = start_param_server(os.path.join(tmp, "ps"), env)
        try:
            trainer_side = TreeClient([address], auth_token=token)
            worker_side = TreeClient([address], auth_token=token)
            worker = InferenceWorker(
                config, param_server=worker_side, consumer_id="bench", mesh=inference_mesh()
            )
            like = worker.param_like()
            for v in range(0, 2 * (versions + 1), 2):
                trainer_side.publish(v, params)  # loaded whole: pull + swap
                t0 = time.perf_counter()
                worker.load(v)
                t1 = time.perf_counter()
                trainer_side.publish(v + 1, params)  # apart: the pull, then the swap
                t_published = time.perf_counter()
                pulled = worker_side.pull(v + 1, like)
                t2 = time.perf_counter()
                worker.load(v + 1, pulled)
                t3 = time.perf_counter()
                if v:  # the first load also compiles nothing but warms the channel
                    loads.append(t1 - t0)
                    pulls.append(t2 - t_published)
                    swaps.append(t3 - t2)
            worker.close()
            trainer_side.close()
            worker_side.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "params": int(sum(np.size(a) for a in leaves)),
        "arrays": len(leaves),
        "bytes": int(sum(np.asarray(a).nbytes for a in leaves)),
        "devices": int(inference_mesh().devices.size),
        "versions": len(loads),
        "load_s": statistics.median(loads),
        "pull_s": statistics.median(pulls),
        "swap_s": statistics.median(swaps),
    }


# -- the served worker: processes on loopback, as a run's controller drives them --------------
GENERATE_REPEATS = 40  # timed Generate calls (and in-process batches): medians


def served_config(model: ModelConfig) -> RunConfig:
    """A rollout worker's config for the RL batch: every sample has a slot, prefill 8 rows."""
    inference = dataclasses.replace(RL_INFERENCE, prefill_batch_size=RL_PROMPTS)
    return RunConfig(model=model, inference=inference, seed=SEED)


def _inference_process(config_path: str, param_server: str, env: dict):
    """`rlax-tpu serve inference CONFIG --param-server ADDRESS` on loopback, in a child that
    gets SIGTERM if this process dies; (process, address, stderr file)."""
    from rlax_tpu.rpc.process import CHILD_LAUNCHER

    stderr = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD_LAUNCHER, "serve", "inference", config_path]
        + [f"--param-server={param_server}", "--host", "127.0.0.1", "--port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    line = process.stdout.readline().strip()
    if not line.startswith("READY "):
        process.kill()
        process.wait()
        stderr.seek(0)
        tail = stderr.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"the inference worker did not start: {line!r}\n{tail}")
    return process, line.split(" ", 1)[1], stderr


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to this process only; SIGKILL if it has not exited within 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def served_worker(
    model: ModelConfig, versions: int = LOAD_VERSIONS, generate_repeats: int = 0
) -> dict:
    """Median Load (through InferenceWorkerClient) of a just-published version of `model` by
    a served worker; with `generate_repeats`, also the RL batch's Generate through it (all
    rollouts streamed back, fresh request ids each call) against the same batch through an
    in-process engine built as the worker builds it, calls of the two interleaved."""
    from rlax_tpu.api.inference import InferenceWorkerClient

    token = secrets.token_hex(16)
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=token, JAX_PLATFORMS="cpu")
    config = served_config(model)
    params = nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(SEED)), nnx.Param))
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "worker.json")
        Path(config_path).write_text(json.dumps(config.to_dict()))
        server, address = start_param_server(os.path.join(tmp, "ps"), env)
        worker = None
        try:
            # _stderr: the worker's log, kept open while it runs (read only on a failed start)
            worker, worker_address, _stderr = _inference_process(config_path, address, env)
            publisher = TreeClient([address], auth_token=token)
            client = InferenceWorkerClient(worker_address, auth_token=token)
            loads = []
            for v in range(versions + 1):
                publisher.publish(v, params)
                t0 = time.perf_counter()
                client.load(v)
                if v:  # the first load also builds the worker's param shapes and channel
                    loads.append(time.perf_counter() - t0)
            out.update(load_s=statistics.median(loads), versions=len(loads))
            if generate_repeats:
                out["generate"] = _served_generate(
                    client, config, params, versions, generate_repeats
                )
            client.close()
            publisher.close()
        finally:
            if worker is not None:
                _stop(worker)
            _stop(server)
    return out


def _served_generate(client, config: RunConfig, params, version: int, repeats: int) -> dict:
    engine = Engine(config.model, config.inference, seed=config.seed, mesh=inference_mesh())
    engine.load(version, params)
    requests = rl_batch_requests(vocab_size=config.model.vocab_size)
    tokens = sum(r.sampling.max_new_tokens for r in requests)

    def served(round_: int) -> float:
        fresh = [dataclasses.replace(r, request_id=f"{r.request_id}.{round_}") for r in requests]
        t0 = time.perf_counter()
        rollouts = list(client.generate(fresh, version=version))
        seconds = time.perf_counter() - t0
        assert len(rollouts) == len(requests) and sum(len(r.tokens) for r in rollouts) == tokens
        return seconds

    def in_process() -> float:
        t0 = time.perf_counter()
        rollouts = engine.run(requests)
        seconds = time.perf_counter() - t0
        assert sum(len(r.tokens) for r in rollouts) == tokens
        return seconds

    served(0), in_process()  # warm-up: both compile the batch's shapes
    served_s, in_process_s = [], []
    for i in range(1, repeats + 1):  # interleaved: load from elsewhere hits both alike
        served_s.append(served(i))
        in_process_s.append(in_process())
    paired = [a - b for a, b in zip(served_s, in_process_s, strict=True)]
    return {
        "requests": len(requests),
        "response_tokens": tokens,
        "prefill_batch_size": engine.prefill_rows,
        "decode_steps_per_call": engine.decode_steps_per_call,
        "devices": int(inference_mesh().devices.size),
        "repeats": repeats,
        "served_ms": round(1e3 * statistics.median(served_s), 2),
        "in_process_ms": round(1e3 * statistics.median(in_process_s), 2),
        "served_best_ms": round(1e3 * min(served_s), 2),
        "in_process_best_ms": round(1e3 * min(in_process_s), 2),
        # What one Generate call costs beyond the engine's work: the RPC, the worker's
        # bookkeeping and thread hand-offs, the rollouts' conversion and streaming.
        "overhead_s": statistics.median(paired),
    }


# -- static batching baseline ------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1))
def _static_generate(graphdef, max_len, state, prompts, lengths, output_lens, key_data):
    """A static batch: prefill all rows together, then decode every row until the longest
    output is done. prompts: int32[batch, bucket] right-padded; lengths, output_lens:
    int32[batch]; key_data: uint32[batch, 2]. Returns tokens int32[batch, max_new_tokens]."""
    model = nnx.merge(graphdef, state)
    batch, bucket = prompts.shape
    c = MODEL
    cache = DenseKVCache.create(
        num_layers=c.num_layers,
        batch=batch,
        max_len=max_len,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=jnp.float32,
    )
    ones = jnp.ones(batch)
    sample = functools.partial(
        sample_tokens,
        key_data=key_data,
        temperature=ones * INFERENCE.temperature,
        top_k=jnp.full(batch, INFERENCE.top_k, jnp.int32),
        top_p=ones * INFERENCE.top_p,
        sampled_logprobs=jnp.zeros(batch, bool),
    )
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
    logits, cache = model.decode(
        prompts, positions, positions < lengths[:, None], cache, logits_index=lengths - 1
    )
    token, _ = sample(logits, token_index=jnp.zeros(batch, jnp.int32))
    out = jnp.zeros((batch, INFERENCE.max_new_tokens), jnp.int32).at[:, 0].set(token)

    def body(carry):
        step, token, cache, out = carry
        logits, cache = model.decode(
            token[:, None], (lengths + step - 1)[:, None], jnp.ones((batch, 1), bool), cache
        )
        token, _ = sample(logits[:, 0], token_index=jnp.full(batch, step, jnp.int32))
        return step + 1, token, cache, out.at[:, step].set(token)

    carry = (jnp.int32(1), token, cache, out)
    _, _, _, out = jax.lax.while_loop(lambda c: c[0] < output_lens.max(), body, carry)
    return out


def static_runner(params, workload: Workload):
    """The static-batch baseline, warm, and its slot utilization (useful / decoded tokens)."""
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    graphdef = nnx.graphdef(model)
    slots = INFERENCE.max_decode_slots
    max_len = INFERENCE.max_prompt_len + INFERENCE.max_new_tokens
    batches = []
    for start in range(0, len(workload.prompts), slots):
        prompts = workload.prompts[start : start + slots]
        outs = workload.output_lens[start : start + slots]
        longest = max(len(p) for p in prompts)
        bucket = next(b for b in INFERENCE.prefill_buckets if b >= longest)
        tokens = np.zeros((slots, bucket), np.int32)  # a short last batch is padded too
        lengths = np.ones(slots, np.int32)
        output_lens = np.ones(slots, np.int32)
        for row, (p, n) in enumerate(zip(prompts, outs, strict=True)):
            tokens[row, : len(p)], lengths[row], output_lens[row] = p, len(p), n
        keys = np.stack([request_key_data(SEED, f"p{start + r}", 0, 0) for r in range(slots)])
        batches.append((tokens, lengths, output_lens, keys))

    def run_all() -> None:
        for batch in batches:
            out = _static_generate(graphdef, max_len, state, *batch)
        jax.block_until_ready(out)

    run_all()  # warm-up: one compile per prompt bucket
    decoded = sum(slots * int(b[2].max()) for b in batches)
    return run_all, workload.useful_tokens / decoded


# -- Tunix (optional peer) ---------------------------------------------------------------------
def tunix_runner(params, workload: Workload):
    """Tunix's vanilla sampler on the same weights, warm: (run, status); run is None without
    the package or when the peer fails (its API may drift; our figures must not be lost)."""
    if importlib.util.find_spec("tunix") is None:
        return None, "not installed (the optional google-tunix package)"
    try:
        run = _tunix_runner(params, workload)
        run()  # warm-up
    except Exception as e:
        return None, f"failed: {type(e).__name__}: {e}"
    return run, "ok"


def _tunix_runner(params, workload: Workload):
    """Our model behind Tunix's transformer interface (per-layer dense cache dicts), run
    batch by batch through `tunix.generate.sampler.Sampler` with top-p 1 sampling."""
    from tunix.generate import sampler as tunix_sampler

    slots = INFERENCE.max_decode_slots
    cache_size = INFERENCE.max_prompt_len + INFERENCE.max_new_tokens

    class Adapter(nnx.Module):
        def __init__(self, model: Transformer):
            self.model = model
            self.num_embed = MODEL.vocab_size

        def __call__(self, tokens, positions, cache, attention_mask, output_hidden_states=False):
            del attention_mask, output_hidden_states  # causal over positions, as ours
            n = MODEL.num_layers
            dense = DenseKVCache(
                keys=tuple(cache[f"layer_{i}"]["k"] for i in range(n)),
                values=tuple(cache[f"layer_{i}"]["v"] for i in range(n)),
            )
            valid = jnp.ones(tokens.shape, bool)
            logits, dense = self.model.decode(tokens, positions, valid, dense)
            end = cache["layer_0"]["end_index"] + tokens.shape[1]
            new = {
                f"layer_{i}": {"k": dense.keys[i], "v": dense.values[i], "end_index": end}
                for i in range(n)
            }
            return logits, new

    class Tokenizer:  # ids in, ids out: the workload is already tokenized
        def encode(self, text):
            return [int(t) for t in text.split()]

        def decode(self, ids):
            return " ".join(str(int(i)) for i in ids)

        def pad_id(self):
            return 0

        def bos_id(self):
            return 0

        def eos_id(self):
            return -1

    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    sampler = tunix_sampler.Sampler(
        Adapter(model),
        Tokenizer(),
        tunix_sampler.CacheConfig(
            cache_size=cache_size,
            num_layers=MODEL.num_layers,
            num_kv_heads=MODEL.num_kv_heads,
            head_dim=MODEL.head_dim,
        ),
    )

    def run_all() -> None:
        for start in range(0, len(workload.prompts), slots):
            prompts = workload.prompts[start : start + slots]
            steps = max(workload.output_lens[start : start + slots])
            sampler(
                [" ".join(map(str, p)) for p in prompts],
                max_generation_steps=steps,
                temperature=INFERENCE.temperature,
                top_p=1.0,
                seed=SEED,
            )

    return run_all


# -- KV budget: pages on demand against pages reserved at admission -----------------------------
KV_SLOTS = 256  # decode slots (--quick: 128): the automatic decode buckets are (64, 128, 256)
# name -> (label, kv_admission, decode_buckets; None = one size, max_decode_slots); the first
# is the baseline: today's engine.
KV_SYSTEMS = {
    "reserved": ("today's engine (reserve, 1 size)", "reserve", None),
    "reserved_buckets": ("reserve + decode buckets", "reserve", ()),
    "on_demand": ("pages on demand", "on_demand", ()),
}
# Pool sizes, as a fraction of the slots' worst case (max_prompt_len + max_new_tokens each).
KV_BUDGETS = {"constrained": 0.25, "unconstrained": 1.0}


def worst_case_budget(sequences: int) -> int:
    """kv_cache_bytes of a pool holding `sequences` worst-case reservations (max_prompt_len +
    max_new_tokens tokens, page-rounded) plus the padding page."""
    c = INFERENCE
    page_bytes = int(MODEL.kv_bytes_per_token()) * c.page_size
    pages = -(-(c.max_prompt_len + c.max_new_tokens) // c.page_size)
    return (sequences * pages + 1) * page_bytes


def stopped_at_length(requests: list[GenerationRequest], probe: list) -> list[GenerationRequest]:
    """`requests` as an RL rollout sends them: max_new_tokens the config's cap (what reserve
    admission reserves pages for) and a stop token that ends each where its `probe` rollout
    (the request as drawn: max_new_tokens = its length, no stop tokens) ended, so every
    system generates the same tokens. The stop token is the last probe token that occurs
    there for the first time: a request whose final token occurred earlier ends at the
    previous first occurrence, a few tokens short of its drawn length."""
    out = []
    for request, rollout in zip(requests, probe, strict=True):
        first: dict[int, int] = {}
        for i, token in enumerate(rollout.tokens):
            first.setdefault(token, i)
        stop = rollout.tokens[max(first.values())]
        sampling = dataclasses.replace(
            request.sampling, max_new_tokens=INFERENCE.max_new_tokens, stop_token_ids=(stop,)
        )
        out.append(dataclasses.replace(request, sampling=sampling))
    return out


def kv_budget_case(
    params,
    num_requests: int,
    decode_steps: int,
    repeats: int,
    slots: int = KV_SLOTS,
    peak_flops: float | None = None,
) -> dict:
    """The heavy-tailed workload on `slots` decode slots, each system of KV_SYSTEMS at each
    pool size of KV_BUDGETS, timed warm (best of `repeats` interleaved rounds), with the
    engine's own counters of the timed run, whether its rollouts equal the baseline's, and
    its MFU against `peak_flops`."""
    drawn = requests_for(make_workload(num_requests))
    engines = {}
    for budget, fraction in KV_BUDGETS.items():
        for name, (_, admission, buckets) in KV_SYSTEMS.items():
            config = dataclasses.replace(
                INFERENCE,
                max_decode_slots=slots,
                kv_cache_bytes=worst_case_budget(round(fraction * slots)),
                kv_admission=admission,
                decode_buckets=(slots,) if buckets is None else buckets,
            )
            engines[budget, name] = Engine(
                MODEL, config, seed=SEED, decode_steps_per_call=decode_steps
            )
            engines[budget, name].load(0, params)
    # Warm-up. Engines of one pool size share their compiled steps, and the on-demand engine
    # uses every decode bucket (all slots live at first, a few at the end): the probe (the
    # requests as drawn) compiles the unconstrained pool's steps, a run of the timed
    # requests the constrained pool's, swap copies included (the schedule is deterministic:
    # the timed runs swap the same page counts). The timed rounds count compiles (none).
    probe = engines["unconstrained", "on_demand"].run(drawn)
    requests = stopped_at_length(drawn, probe)
    engines["constrained", "on_demand"].run(requests)

    last: dict = {}  # (budget, name) -> (rollouts, stats before, stats after) of its last run

    def runner(key):
        engine = engines[key]

        def run() -> None:
            before = engine.stats()
            rollouts = engine.run(requests)
            last[key] = rollouts, before, engine.stats()

        return run

    compiles = []
    timing = [True]

    def on_event(event: str, duration_s: float, **_) -> None:
        if timing[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    seconds = best_seconds({key: runner(key) for key in engines}, repeats)
    timing[0] = False

    baseline = next(iter(KV_SYSTEMS))
    timed = last["constrained", baseline][0]
    flops = rollouts_flops_per_token(timed)
    out: dict = {
        "requests": num_requests,
        "model_flops_per_token": round(flops),
        "response_tokens": sum(len(r.tokens) for r in timed),
        "drawn_response_tokens": sum(len(r.tokens) for r in probe),
        # Each timed rollout is its probe's up to the stop token (the same work everywhere).
        "stopped_as_probed": all(
            r.finish_reason == "stop" and p.tokens[: len(r.tokens)] == r.tokens
            for r, p in zip(timed, probe, strict=True)
        ),
        "max_new_tokens": INFERENCE.max_new_tokens,
        "decode_slots": slots,
        "decode_rows": list(engines["constrained", "on_demand"].decode_rows),
        "decode_steps_per_call": decode_steps,
        "prefill_batch_size": INFERENCE.prefill_rows,
        "repeats": repeats,
        "compiles_while_timed": len(compiles),
        "budgets": {},
    }
    for budget, fraction in KV_BUDGETS.items():
        reference = last[budget, baseline][0]
        rows = {}
        for name in KV_SYSTEMS:
            rollouts, before, after = last[budget, name]
            tokens = after["tokens_generated"] - before["tokens_generated"]
            calls = after["decode_calls"] - before["decode_calls"]
            live = (
                after["mean_live_sequences"] * after["decode_calls"]
                - before["mean_live_sequences"] * before["decode_calls"]
            )
            preemptions = after["preemptions"] - before["preemptions"]
            swap_bytes = sum(after[k] - before[k] for k in ("swap_out_bytes", "swap_in_bytes"))
            rows[name] = {
                "tokens": tokens,
                "seconds": round(seconds[budget, name], 3),
                "tokens_per_s": round(tokens / seconds[budget, name], 1),
                "mfu": token_mfu(tokens / seconds[budget, name], flops, peak_flops),
                "decode_calls": calls,
                "mean_live_sequences": round(live / max(1, calls), 1),
                "preemptions_per_1k_tokens": round(1e3 * preemptions / tokens, 3),
                "swap_bytes_per_1k_tokens": round(1e3 * swap_bytes / tokens),
                "preemptions": preemptions,
                "swap_bytes": swap_bytes,
                "rollouts_equal_baseline": rollouts == reference,
            }
        for row in rows.values():
            row["speedup"] = round(row["tokens_per_s"] / rows[baseline]["tokens_per_s"], 3)
        engine = engines[budget, baseline]
        out["budgets"][budget] = {
            "worst_case_sequences": round(fraction * slots),
            "kv_cache_bytes": engine.config.kv_cache_bytes,
            "pages": engine.stats()["total_pages"],  # the padding page not counted
            "rows": rows,
            "speedup_on_demand_vs_reserved": rows["on_demand"]["speedup"],
            "rollouts_equal": all(row["rollouts_equal_baseline"] for row in rows.values()),
        }
    return out


# -- a GRPO group's shared prompt pages ---------------------------------------------------------
GROUP_PROMPT_TOKENS = 512
GROUP_SLOTS = 64  # every sample of the batch in flight at once, as in a rollout worker
GROUP_SIZES = (4, 8, 16)


def group_requests(k: int, seed: int = SEED) -> list[GenerationRequest]:
    """GROUP_SLOTS / k prompts of GROUP_PROMPT_TOKENS tokens, k samples each (a GRPO batch),
    16-128 new tokens per sample (no stop token: every engine generates the same work)."""
    rng = np.random.default_rng(seed + k)
    base = SamplingParams.from_config(INFERENCE)
    out = []
    for p in range(GROUP_SLOTS // k):
        tokens = tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, GROUP_PROMPT_TOKENS))
        for i in range(k):
            sampling = dataclasses.replace(
                base, max_new_tokens=int(rng.integers(16, 129)), stop_token_ids=()
            )
            out.append(GenerationRequest(f"g{k}.{p}.{i}", f"g{k}.{p}", i, tokens, sampling))
    return out


def _group_runner(engine: Engine, requests: list, last: dict, name: str):
    """A run of `requests` through `engine`, stepped by hand to see the most KV pages in
    use; its rollouts, prefill counters and that peak go to `last[name]`."""

    def run() -> None:
        before, peak, done = engine.stats(), 0, []
        for r in requests:
            engine.submit(r)
        while engine.has_work():
            done += engine.step()
            stats = engine.stats()
            peak = max(peak, stats["total_pages"] - stats["free_pages"])
        after = engine.stats()
        delta = {key: after[key] - before[key] for key in ("prefill_tokens", "prefills")}
        last[name] = sorted(done, key=lambda r: r.request_id), delta, peak

    return run


def group_case(
    params, decode_steps: int, repeats: int, sizes=GROUP_SIZES, peak_flops: float | None = None
) -> dict:
    """Each group size k: the same batch through an engine that shares a group's prompt
    pages (inference.share_prompt_pages, the default) and one that prefills every sample
    (today's engine before it), both with 8 prefill rows and a pool holding every sample
    unshared; timed warm (best of `repeats` interleaved rounds). Per group: the prompt
    tokens prefilled and their model FLOPs, and the most KV pages in use at once; each
    engine's MFU against `peak_flops` counts the decoded tokens' FLOPs (the same for both:
    the prompts' prefill, which sharing saves, is not counted)."""
    config = dataclasses.replace(
        INFERENCE,
        max_decode_slots=GROUP_SLOTS,
        prefill_batch_size=8,
        prefill_buckets=(GROUP_PROMPT_TOKENS,),
        max_prompt_len=GROUP_PROMPT_TOKENS,
        max_new_tokens=128,
        # Every sample at its longest, unshared: pages never limit either engine.
        kv_cache_bytes=(GROUP_SLOTS * -(-(GROUP_PROMPT_TOKENS + 128) // 16) + 1)
        * int(MODEL.kv_bytes_per_token())
        * 16,
        page_size=16,
    )
    prefill_flops = decode_flops_per_token(MODEL, GROUP_PROMPT_TOKENS / 2)
    out: dict = {
        "prompt_tokens": GROUP_PROMPT_TOKENS,
        "decode_slots": GROUP_SLOTS,
        "prefill_batch_size": 8,
        "decode_steps_per_call": decode_steps,
        "new_tokens": "uniform 16-128 per sample",
        "sizes": {},
    }
    for k in sizes:
        requests = group_requests(k)
        engines = {
            name: Engine(
                MODEL,
                dataclasses.replace(config, share_prompt_pages=share),
                seed=SEED,
                decode_steps_per_call=decode_steps,
            )
            for name, share in (("shared", True), ("unshared", False))
        }
        last: dict = {}
        runs = {name: _group_runner(engines[name], requests, last, name) for name in engines}
        for name, engine in engines.items():
            engine.load(0, params)
            runs[name]()  # warm-up: compiles
        seconds = best_seconds(runs, repeats)
        groups = len(requests) // k
        tokens = sum(len(r.tokens) for r in last["shared"][0])
        flops = rollouts_flops_per_token(last["shared"][0])
        row: dict = {
            "groups": groups,
            "requests": len(requests),
            "new_tokens": tokens,
            "model_flops_per_token": round(flops),
        }
        for name in engines:
            _, delta, peak = last[name]
            row[name] = {
                "seconds": round(seconds[name], 4),
                "tokens_per_s": round(tokens / seconds[name], 1),
                "mfu": token_mfu(tokens / seconds[name], flops, peak_flops),
                "prefill_tokens_per_group": delta["prefill_tokens"] / groups,
                "prefill_flops_per_group": delta["prefill_tokens"] / groups * prefill_flops,
                "peak_kv_pages": peak,
                "kv_pages_per_group": round(peak / groups, 1),
            }
        row["speedup_shared_prefix"] = round(seconds["unshared"] / seconds["shared"], 3)
        row["bitwise_equal"] = last["shared"][0] == last["unshared"][0]
        out["sizes"][str(k)] = row
    out["speedup_shared_prefix"] = out["sizes"].get("8", {}).get("speedup_shared_prefix")
    return out


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def print_group_case(group: dict) -> None:
    print(
        f"shared prompt pages: {GROUP_SLOTS} samples in flight, {group['prompt_tokens']}-token "
        f"prompts, {group['new_tokens']}, prefill_batch_size {group['prefill_batch_size']}"
    )
    print(
        f"{'k':>4}{'system':>10}{'tokens/s':>11}{'ratio':>8}{'MFU':>8}{'prefill tok/group':>19}"
        f"{'GFLOP/group':>13}{'KV pages/group':>16}{'bitwise':>9}"
    )
    for k, row in group["sizes"].items():
        for name in ("unshared", "shared"):
            r = row[name]
            ratio = row["speedup_shared_prefix"] if name == "shared" else 1.0
            print(
                f"{k:>4}{name:>10}{r['tokens_per_s']:>11.1f}{ratio:>7.2f}x{_percent(r['mfu']):>8}"
                f"{r['prefill_tokens_per_group']:>19.0f}{r['prefill_flops_per_group'] / 1e9:>13.2f}"
                f"{r['kv_pages_per_group']:>16.1f}{str(row['bitwise_equal']):>9}"
            )


def print_kv_budget(kv: dict) -> None:
    """The KV-budget case's tables: one per pool size, ratios against today's engine."""
    print(
        f"KV budget: {kv['requests']} requests, {kv['response_tokens']} response tokens "
        f"(lognormal lengths, each ended by a stop token; max_new_tokens "
        f"{kv['max_new_tokens']}), {kv['decode_slots']} decode slots, decode buckets "
        f"{tuple(kv['decode_rows'])}, {kv['decode_steps_per_call']} steps per call, best of "
        f"{kv['repeats']}; compiles while timed: {kv['compiles_while_timed']}"
    )
    if not kv["stopped_as_probed"]:
        print("  !!! the timed rollouts did not stop where their probe runs ended !!!")
    for budget, b in kv["budgets"].items():
        print(
            f"{budget} pool: {b['worst_case_sequences']} worst-case sequences = {b['pages']} "
            f"pages + padding, {b['kv_cache_bytes'] / 2**20:.1f} MiB"
        )
        print(
            f"  {'system':<34}{'tokens/s':>10}{'vs today':>10}{'MFU':>8}{'live/call':>11}"
            f"{'preempt/1k':>12}{'swap MiB/1k':>13}"
        )
        for name, r in b["rows"].items():
            print(
                f"  {KV_SYSTEMS[name][0]:<34}{r['tokens_per_s']:>10.1f}{r['speedup']:>9.2f}x"
                f"{_percent(r['mfu']):>8}{r['mean_live_sequences']:>11.1f}"
                f"{r['preemptions_per_1k_tokens']:>12.2f}"
                f"{r['swap_bytes_per_1k_tokens'] / 2**20:>13.2f}"
            )
        if b["rollouts_equal"]:
            print("  rollouts: every system's equal today's engine's (bitwise)")
        else:
            rows = b["rows"].items()
            differ = [KV_SYSTEMS[n][0] for n, r in rows if not r["rollouts_equal_baseline"]]
            print(f"  !!! ROLLOUTS DIFFER from today's engine's: {', '.join(differ)} !!!")


# -- quantized serving: int8 / fp8 projections against bf16 ---------------------------------------
QUANTIZED = ("", "int8", "fp8")  # inference.weight_dtype; "" = the bf16 baseline
QUANT_PROMPT_TOKENS = 16
QUANT_LOAD_VERSIONS = 5  # loads of fresh versions after the first (medians)


def quantized_models() -> dict[str, ModelConfig]:
    """The demo's model (configs/tiny_cpu.py) and the ~20M-parameter model of
    tools/bench_e2e.py, served bf16 (bf16 published weights, bf16 compute)."""
    from bench_e2e import SIZE_20M

    from rlax_tpu.config import load_config

    demo = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    m20 = demo.apply_overrides([o for o in SIZE_20M if o.startswith("model.")])
    return {
        name: dataclasses.replace(config.model, dtype="bfloat16", publish_dtype="bfloat16")
        for name, config in (("demo", demo), ("20m", m20))
    }


def _recompute_mismatch(model: ModelConfig, params, rollouts, seq: int) -> dict:
    """|behaviour log-prob − the trainer's recompute from the unquantized weights| over the
    rollouts' response tokens (the trainer's mismatch metric; also max)."""
    from rlax_tpu.controller.assembly import rollout_rows
    from rlax_tpu.trainer.step import mismatch_metrics, recompute_logprobs

    rows = len(rollouts)
    tokens, mask, behaviour = rollout_rows(rollouts, seq)
    abstract = nnx.eval_shape(lambda: Transformer(model.served(), rngs=nnx.Rngs(0)))
    graphdef = nnx.split(abstract, nnx.Param)[0]
    recomputed = np.asarray(
        jax.jit(lambda p, t: recompute_logprobs(graphdef, p, t, micro_size=rows))(params, tokens)
    )
    metrics = mismatch_metrics(recomputed, behaviour, mask)
    return {
        "mean": float(metrics["mismatch/recomputed_vs_cached_mean"]),
        "p95": float(metrics["mismatch/recomputed_vs_cached_p95"]),
        "max": float(np.abs(recomputed - behaviour)[mask].max()),
    }


def quantized_case(repeats: int, rows: int, new_tokens: int) -> dict:
    """Each model: engines serving the same bf16 weights as published (the baseline), int8
    and fp8 (inference.weight_dtype), in one run. Per engine: the served weights' bytes, a
    load of a fresh version (quantization at load included: the first load, which also
    compiles the quantizers, and the median of later ones), generation tokens/s of `rows`
    requests of QUANT_PROMPT_TOKENS-token prompts and `new_tokens` new tokens each (no stop
    token; decode is most of it), best of `repeats` interleaved rounds, and the behaviour
    log-probs' mismatch against the trainer's recompute from the unquantized weights; MFU
    against the measured bfloat16 matmul peak (the compute dtype)."""
    peak = matmul_flops_per_s(dtype=jnp.bfloat16)
    out: dict = {
        "rows": rows,
        "prompt_tokens": QUANT_PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "compute_dtype": "bfloat16",
        "matmul_flops_per_s": round(peak),
        "models": {},
    }
    inference = dataclasses.replace(
        INFERENCE,
        max_decode_slots=rows,
        prefill_batch_size=rows,
        prefill_buckets=(QUANT_PROMPT_TOKENS,),
        max_prompt_len=QUANT_PROMPT_TOKENS,
        max_new_tokens=new_tokens,
        decode_buckets=(rows,),
    )
    base = SamplingParams.from_config(inference)
    sampling = dataclasses.replace(base, max_new_tokens=new_tokens, stop_token_ids=())
    for name, model in quantized_models().items():
        rng = np.random.default_rng(SEED)
        requests = [
            GenerationRequest(
                f"q{i}",
                f"q{i}",
                0,
                tuple(int(t) for t in rng.integers(0, model.vocab_size, QUANT_PROMPT_TOKENS)),
                sampling,
            )
            for i in range(rows)
        ]
        params = nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(SEED)), nnx.Param))
        # As a worker's pull gives them: the published dtype, on the device.
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
        pool = rows * -(-(QUANT_PROMPT_TOKENS + new_tokens) // 16) + 1
        config = dataclasses.replace(
            inference, kv_cache_bytes=pool * 16 * int(model.kv_bytes_per_token())
        )
        engines, loads, runs, last = {}, {}, {}, {}
        for weight_dtype in QUANTIZED:
            engine = Engine(
                model, dataclasses.replace(config, weight_dtype=weight_dtype), seed=SEED,
                decode_steps_per_call=4,
            )  # fmt: skip
            times = []
            for version in range(QUANT_LOAD_VERSIONS + 1):
                fresh = jax.block_until_ready(jax.tree.map(jnp.copy, params))
                t0 = time.perf_counter()
                engine.load(version, fresh)
                jax.block_until_ready(engine.served_params())
                times.append(time.perf_counter() - t0)
            engine.load(QUANT_LOAD_VERSIONS + 1, params)
            engines[weight_dtype], loads[weight_dtype] = engine, times

            def run(engine=engine, key=weight_dtype, requests=requests, last=last) -> None:
                last[key] = engine.run(requests)

            run()  # warm-up: compiles
            runs[weight_dtype] = run
        seconds = best_seconds(runs, repeats)
        tokens = rows * new_tokens
        row: dict = {"params": int(sum(np.size(x) for x in jax.tree.leaves(params))), "by": {}}
        for weight_dtype, engine in engines.items():
            label = weight_dtype or "bf16"
            assert sum(len(r.tokens) for r in last[weight_dtype]) == tokens
            flops = rollouts_flops_per_token(last[weight_dtype], model)
            row["by"][label] = {
                "weight_bytes": int(sum(x.nbytes for x in engine.served_params())),
                "first_load_s": round(loads[weight_dtype][0], 4),
                "load_s": round(statistics.median(loads[weight_dtype][1:]), 4),
                "tokens_per_s": round(tokens / seconds[weight_dtype], 1),
                "mfu": token_mfu(tokens / seconds[weight_dtype], flops, peak),
                "logprob_mismatch": _recompute_mismatch(
                    model, params, last[weight_dtype], QUANT_PROMPT_TOKENS + new_tokens
                ),
            }
        baseline = row["by"]["bf16"]
        for r in row["by"].values():
            r["weight_bytes_ratio"] = round(r["weight_bytes"] / baseline["weight_bytes"], 3)
            r["tokens_per_s_ratio"] = round(r["tokens_per_s"] / baseline["tokens_per_s"], 3)
            r["quantize_at_load_s"] = round(r["load_s"] - baseline["load_s"], 4)
        out["models"][name] = row
    return out


def print_quantized_case(q: dict) -> None:
    print(
        f"quantized serving ({q['compute_dtype']} compute): {q['rows']} requests of "
        f"{q['prompt_tokens']}-token prompts, {q['new_tokens']} new tokens each, best of "
        f"{q['repeats']}; ratios against the bf16 engine of the same run"
    )
    print(
        f"{'model':>6}{'weights':>8}{'MiB':>8}{'ratio':>7}{'load ms':>9}{'1st ms':>8}"
        f"{'tokens/s':>10}{'ratio':>7}{'MFU':>8}{'|dlogp| mean':>14}{'p95':>9}{'max':>9}"
    )
    for name, row in q["models"].items():
        for label, r in row["by"].items():
            m = r["logprob_mismatch"]
            print(
                f"{name:>6}{label:>8}{r['weight_bytes'] / 2**20:>8.2f}"
                f"{r['weight_bytes_ratio']:>6.2f}x{r['load_s'] * 1e3:>9.1f}"
                f"{r['first_load_s'] * 1e3:>8.0f}{r['tokens_per_s']:>10.1f}"
                f"{r['tokens_per_s_ratio']:>6.2f}x{_percent(r['mfu']):>8}"
                f"{m['mean']:>14.2e}{m['p95']:>9.2e}{m['max']:>9.2e}"
            )


# -- roofline ------------------------------------------------------------------------------------
def matmul_flops_per_s(n: int = 1024, repeats: int = 10, dtype=jnp.float32) -> float:
    """The best [n, n] x [n, n] rate (in `dtype`, float32 by default) jitted XLA reaches on
    this machine: the peak every `mfu` here is against."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def flops_per_token(workload: Workload, model: ModelConfig = MODEL) -> float:
    """Matmul FLOPs of one decode token of `model` at the mean context of the workload's
    response tokens: the simulator's count (`decode_flops_per_token`), so its calibration
    transfers."""
    contexts = [
        len(p) + t
        for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        for t in range(n)
    ]
    return decode_flops_per_token(model, float(np.mean(contexts)))


def rollouts_flops_per_token(rollouts, model: ModelConfig = MODEL) -> float:
    """`flops_per_token` of the work `rollouts` did: their prompts and response lengths."""
    prompts = [r.prompt_tokens for r in rollouts]
    return flops_per_token(Workload(prompts, [len(r.tokens) for r in rollouts]), model)


def token_mfu(
    tokens_per_s: float | None, flops_per_token: float, peak_flops: float | None
) -> float | None:
    """Model FLOPs utilisation of a generation rate: tokens/s x model FLOPs a token over the
    measured matmul peak (`matmul_flops_per_s`); None without a rate or a peak."""
    if tokens_per_s is None or not peak_flops:
        return None
    return round(perf.mfu(tokens_per_s * flops_per_token, 1.0, peak_flops), 6)


def best_seconds(runs: dict, repeats: int) -> dict:
    """Best wall time of each runner over `repeats` rounds, the systems interleaved within a
    round so that load from other processes on a shared machine hits them alike."""
    best = {name: float("inf") for name, run in runs.items() if run is not None}
    for _ in range(repeats):
        for name in best:
            t0 = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="64 requests, 2 timed rounds; KV budget: 192 requests on 128 slots",
    )
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--requests", type=int, help="number of requests (default 256)")
    parser.add_argument("--repeats", type=int, help="timed rounds; the best counts (default 3)")
    parser.add_argument(
        "--decode-steps", type=int, default=4, help="engine decode steps per device call"
    )
    parser.add_argument(
        "--kv-requests", type=int, help="requests of the KV-budget case (default 1024; quick 192)"
    )
    parser.add_argument(
        "--kv-repeats", type=int, default=1, help="timed rounds of the KV-budget case (default 1)"
    )
    parser.add_argument(
        "--group-only",
        action="store_true",
        help="run only the shared-prompt-pages case (GRPO groups of 4, 8, 16 samples)",
    )
    parser.add_argument(
        "--quantized-only",
        action="store_true",
        help="run only the quantized-serving case: int8 and fp8 projections against bf16 "
        "(demo and 20m models; --quantized-rows, --quantized-new-tokens)",
    )
    parser.add_argument(
        "--quantized-rows", type=int, default=16, help="requests (= decode slots), default 16"
    )
    parser.add_argument(
        "--quantized-new-tokens", type=int, default=32, help="new tokens a request, default 32"
    )
    args = parser.parse_args(argv)
    if args.quantized_only:
        quantized = quantized_case(
            args.repeats or 3, args.quantized_rows, args.quantized_new_tokens
        )
        figures = {
            "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
            "host": host_cpu(),
            "cpu_count": os.cpu_count(),
            "quantized": quantized,
        }
        print_quantized_case(quantized)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        return 0
    if args.group_only:
        params = nnx.to_pure_dict(nnx.state(Transformer(MODEL, rngs=nnx.Rngs(SEED)), nnx.Param))
        matmul_rate = matmul_flops_per_s()
        group = group_case(params, args.decode_steps, args.repeats or 3, peak_flops=matmul_rate)
        figures = {
            "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
            "host": host_cpu(),
            "cpu_count": os.cpu_count(),
            "matmul_flops_per_s": round(matmul_rate),
            "speedup_shared_prefix": group["speedup_shared_prefix"],
            "group": group,
        }
        print_group_case(group)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        return 0
    num_requests = args.requests or (64 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 3)
    kv_requests = args.kv_requests or (192 if args.quick else 1024)
    kv_slots = KV_SLOTS // 2 if args.quick else KV_SLOTS

    workload = make_workload(num_requests)
    tokens = workload.useful_tokens
    params = nnx.to_pure_dict(nnx.state(Transformer(MODEL, rngs=nnx.Rngs(SEED)), nnx.Param))
    engine, run_engine = engine_runner(params, workload, args.decode_steps)
    run_static, static_utilization = static_runner(params, workload)
    run_tunix, tunix_status = tunix_runner(params, workload)
    runs = {"engine": run_engine, "static": run_static, "tunix": run_tunix}
    rl_engines = {}
    for name, rows in [("rl_prefill_1", 1), ("rl_prefill_8", 8)]:
        rl_engines[name], runs[name] = rl_batch_runner(params, rows, args.decode_steps)
    seconds = best_seconds(runs, repeats)
    rl_seconds = {name: seconds.pop(name) for name in rl_engines}
    rate = {name: tokens / s for name, s in seconds.items()}
    ours, static, tunix = rate["engine"], rate["static"], rate.get("tunix")
    stats = engine.stats()
    flops = flops_per_token(workload)
    matmul_rate = matmul_flops_per_s()
    roofline = matmul_rate / flops
    kv = kv_budget_case(
        params, kv_requests, args.decode_steps, args.kv_repeats, kv_slots, matmul_rate
    )
    group = group_case(
        params, args.decode_steps, repeats, (8,) if args.quick else GROUP_SIZES, matmul_rate
    )

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b, 3)

    figures = {
        "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "host": host_cpu(),
        "cpu_count": os.cpu_count(),
        "requests": num_requests,
        "useful_tokens": tokens,
        "decode_slots": INFERENCE.max_decode_slots,
        "decode_steps_per_call": args.decode_steps,
        "repeats": repeats,
        "tokens_per_s": round(ours, 1),
        # Each rate's model FLOPs (model_flops_per_token a token) over matmul_flops_per_s.
        "mfu": token_mfu(ours, flops, matmul_rate),
        "static_batch_tokens_per_s": round(static, 1),
        "static_batch_mfu": token_mfu(static, flops, matmul_rate),
        "speedup_vs_static": ratio(ours, static),
        "tunix_tokens_per_s": None if tunix is None else round(tunix, 1),
        "tunix_mfu": token_mfu(tunix, flops, matmul_rate),
        "speedup_vs_tunix": ratio(ours, tunix),
        "tunix_status": tunix_status,
        "prefill_batch_size": engine.prefill_rows,
        "prefill_calls_per_run": stats["prefill_calls"] // (1 + repeats),
        "decode_calls_per_run": stats["decode_calls"] // (1 + repeats),
        "compiles": stats["compiled_shapes"],
        "compiled_shapes": stats["compiled"],
        "slot_utilization": round(stats["slot_utilization"], 3),
        "static_batch_slot_utilization": round(static_utilization, 3),
        "model_flops_per_token": round(flops),
        "matmul_flops_per_s": round(matmul_rate),
        "roofline_tokens_per_s": round(roofline, 1),
        "fraction_of_roofline": round(ours / roofline, 4),
        # Pages on demand against today's engine (pages reserved for max_new_tokens at
        # admission, one decode size) at a KV budget of a quarter of the slots' worst case.
        "speedup_on_demand_vs_reserved": kv["budgets"]["constrained"][
            "speedup_on_demand_vs_reserved"
        ],
        "kv_budget": kv,
        # A GRPO group's samples sharing their prompt's prefill and pages, against each
        # sample prefilled alone (k = 8, 512-token prompts).
        "speedup_shared_prefix": group["speedup_shared_prefix"],
        "group": group,
        "rl_batch": {
            "requests": RL_PROMPTS * RL_SAMPLES,
            "decode_slots": RL_INFERENCE.max_decode_slots,
            "prefill_batch_size": {name: rl_engines[name].prefill_rows for name in rl_engines},
            "ms_per_batch": {name: round(1e3 * s, 1) for name, s in rl_seconds.items()},
            "prefill_calls_per_batch": {
                name: e.stats()["prefill_calls"] // (1 + repeats) for name, e in rl_engines.items()
            },
            "speedup": round(rl_seconds["rl_prefill_1"] / rl_seconds["rl_prefill_8"], 3),
            "devices": int(inference_mesh().devices.size),
            "decode_steps_per_call": args.decode_steps,
            "decode_calls_per_batch": {
                name: e.stats()["decode_calls"] // (1 + repeats) for name, e in rl_engines.items()
            },
            # Padded prefill work: rows x bucket per call (every RL prompt is in bucket 64).
            "prefill_bucket": 64,
        },
        "worker_load": {
            "tiny": worker_load(ModelConfig()),
            "bench": worker_load(MODEL),
        },
    }
    # The served worker: Load of each version (both models); Generate of the RL batch on the
    # tiny model (the demo's size: its engine time, ~60 ms, leaves the call's overhead
    # measurable above the run-to-run noise, which is larger than it on this benchmark's model).
    generate_repeats = GENERATE_REPEATS // 2 if args.quick else GENERATE_REPEATS
    served = {
        "tiny": served_worker(ModelConfig(), generate_repeats=generate_repeats),
        "bench": served_worker(MODEL),
    }
    for name, r in served.items():
        figures["worker_load"][name]["served_load_s"] = r["load_s"]
        figures["worker_load"][name]["served_versions"] = r["versions"]
    figures["served_generate"] = {"model": "tiny", **served["tiny"]["generate"]}
    print(f"{num_requests} requests, {tokens} response tokens, {figures['device']}")
    print(f"{'system':<32}{'tokens/s':>12}{'vs static':>12}{'MFU':>9}")
    for name, value in [
        ("rlax_tpu engine (continuous)", ours),
        ("static batch, dense cache", static),
        ("tunix vanilla sampler", tunix),
    ]:
        shown = "n/a" if value is None else f"{value:.1f}"
        rel = "" if value is None else f"{value / static:.2f}x"
        print(f"{name:<32}{shown:>12}{rel:>12}{_percent(token_mfu(value, flops, matmul_rate)):>9}")
    print(f"tunix: {tunix_status}")
    print(
        f"compiled shapes: {stats['compiled_shapes']} {stats['compiled']}; slot utilization "
        f"{figures['slot_utilization']} (static {figures['static_batch_slot_utilization']})"
    )
    print(
        f"roofline: {round(flops)} FLOPs/token at {matmul_rate / 1e9:.1f} GFLOP/s = "
        f"{roofline:.0f} tokens/s; the engine reaches {figures['fraction_of_roofline']:.1%}"
    )
    rl = figures["rl_batch"]
    print(
        f"RL batch ({rl['requests']} requests, 8 prompts x 8 samples, 4-16 new tokens): "
        + ", ".join(
            f"prefill_batch_size={rl['prefill_batch_size'][name]}: {ms:.1f} ms/batch "
            f"({rl['prefill_calls_per_batch'][name]} prefill calls)"
            for name, ms in rl["ms_per_batch"].items()
        )
        + f"; {rl['speedup']:.2f}x"
    )
    print_kv_budget(kv)
    print_group_case(group)
    for name, r in figures["worker_load"].items():
        print(
            f"worker load ({name} model, {r['arrays']} arrays, {r['bytes'] / 2**20:.2f} MB, "
            f"{r['devices']} device(s)): {r['load_s'] * 1e3:.1f} ms = pull "
            f"{r['pull_s'] * 1e3:.1f} + swap {r['swap_s'] * 1e3:.1f} (medians of {r['versions']})"
        )
    for name, r in figures["worker_load"].items():
        print(
            f"served worker load ({name} model): {r['served_load_s'] * 1e3:.1f} ms through "
            f"InferenceWorkerClient.load (median of {r['served_versions']}), in-process "
            f"{r['load_s'] * 1e3:.1f} ms"
        )
    g = figures["served_generate"]
    print(
        f"served Generate of the RL batch ({g['model']} model, {g['requests']} requests, "
        f"prefill_batch_size="
        f"{g['prefill_batch_size']}, {g['decode_steps_per_call']} decode step per call): "
        f"{g['served_ms']:.1f} ms streamed back vs {g['in_process_ms']:.1f} ms in-process "
        f"-> {g['overhead_s'] * 1e3:.1f} ms per call (medians of {g['repeats']})"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
