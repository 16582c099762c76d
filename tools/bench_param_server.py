#!/usr/bin/env python3
"""Parameter-server throughput against bare gRPC byte streams and an in-memory copy.

    python tools/bench_param_server.py [--quick] [--json OUT]

In one run: start a real parameter-server process (persistent storage in a temporary
directory) and bare gRPC streaming servers on loopback; publish a model-shaped tree of
~100 MB (and ~1 GB without --quick) as REPEATS successive versions, pull each right after
its publish and again; stream the same bytes through the bare servers in both directions;
copy them in memory; pull one tensor-parallel-2 shard to measure the bytes a sharded worker
moves; and time a publish plus a worker's load of the demo model. Prints tables with the
ratios against the baselines measured in the same run.

Figures (throughputs are the best of REPEATS: a 2-core machine is noisy):

* `publish_bytes_per_s`: a publish of a new version (every byte moves; the server hashes
  them; storage is written after the commit, outside the timing: the benchmark waits for
  it between versions, as the trainer's next step does not). Against
  `raw_publish_bytes_per_s`, a bare client-streaming call of the same bytes into an array:
  `publish_vs_raw_grpc`.
* `first_pull_bytes_per_s` (cold): the first pull of each new version, right after its
  publish, as the first worker to load a version gets it. `pull_bytes_per_s`: later pulls
  of the same version, as further workers get it. Against `raw_grpc_bytes_per_s`, a bare
  server-streaming call of the same bytes into an array: `cold_pull_vs_raw_grpc`,
  `pull_vs_raw_grpc`.
* `first_publish_bytes_per_s` / `first_version_pull_bytes_per_s`: version 0 on a fresh
  server and channel (one-time costs: flow-control windows that grow with traffic, memory
  touched for the first time), with the first bare streams as their baselines.
* `publish_load_ms_small`: the demo model (configs/tiny_cpu.py's at tools/bench_e2e.py
  --quick's size, 140k parameters in 21 arrays) published from device
  arrays as the trainer does, then pulled onto a device as a worker loads it (median over
  versions): the fixed cost of a version that the 100 MB rates cannot show.
* `small`: trees of <1 MB in 8 and 32 arrays, each published as a new version, pulled once
  right after (cold) and once more (warm), many times; medians. tools/validate_simulator.py
  calibrates the simulator's publish_fixed_s / pull_fixed_s and their per-array terms from
  them.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT / "tools"))

from rlax_tpu.api import tensors as layout  # noqa: E402
from rlax_tpu.api.param_server import (  # noqa: E402
    split_dims_from_logical,
)
from rlax_tpu.param_server.trees import TreeClient  # noqa: E402

CHUNK_BYTES = 4 * 2**20
REPEATS = 5  # throughputs are the best of this many runs (a 2-core machine is noisy)
RAW_METHOD, RAW_SINK = "/bench.Raw/Stream", "/bench.Raw/Sink"
SMALL_TREES = (8, 32)  # arrays in a tiny-model-shaped tree of SMALL_BYTES
SMALL_BYTES = 2**19
SMALL_REPEATS = 40  # versions published and pulled per small tree (medians)

_RAW_SERVER = r"""
import sys, grpc
import numpy as np
from concurrent import futures
from rlax_tpu.rpc import MAX_MESSAGE_BYTES
total, chunk = int(sys.argv[1]), int(sys.argv[2])
payload = bytes(chunk)
def stream(request, context):
    for offset in range(0, total, chunk):
        yield payload[: min(chunk, total - offset)]
def sink(requests, context):  # the received bytes land in an array, as a publish's do
    out, received = np.empty(total, np.uint8), 0
    for data in requests:
        out[received : received + len(data)] = np.frombuffer(data, np.uint8)
        received += len(data)
    return str(received).encode()
identity = dict(request_deserializer=lambda b: b, response_serializer=lambda b: b)
handler = grpc.method_handlers_generic_handler("bench.Raw", {
    "Stream": grpc.unary_stream_rpc_method_handler(stream, **identity),
    "Sink": grpc.stream_unary_rpc_method_handler(sink, **identity)})
options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(f"READY 127.0.0.1:{port}", flush=True)
server.wait_for_termination()
"""


def model_tree(target_bytes: int, seed: int = 0):
    """A Llama-shaped float32 tree of about `target_bytes`, with its tensor-split dims."""
    hidden, heads, head_dim, mlp, vocab = 1024, 8, 128, 4096, 4096
    per_layer = 4 * hidden * heads * head_dim + 3 * hidden * mlp + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, (target_bytes // 4 - fixed) // per_layer)
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    tree, logical = {"embed": arr(vocab, hidden), "lm_head": arr(hidden, vocab)}, {}
    logical["embed"], logical["lm_head"] = ("vocab", "embed"), ("embed", "vocab")
    tree["final_norm"], logical["final_norm"] = arr(hidden), ("norm",)
    for i in range(layers):
        p = f"layers/{i}"
        for name, shape, axes in [
            ("attn/wq", (hidden, heads, head_dim), ("embed", "heads", "head_dim")),
            ("attn/wk", (hidden, heads, head_dim), ("embed", "kv_heads", "head_dim")),
            ("attn/wv", (hidden, heads, head_dim), ("embed", "kv_heads", "head_dim")),
            ("attn/wo", (heads, head_dim, hidden), ("heads", "head_dim", "embed")),
            ("mlp/w_gate", (hidden, mlp), ("embed", "mlp")),
            ("mlp/w_up", (hidden, mlp), ("embed", "mlp")),
            ("mlp/w_down", (mlp, hidden), ("mlp", "embed")),
            ("attn_norm", (hidden,), ("norm",)),
            ("mlp_norm", (hidden,), ("norm",)),
        ]:
            tree[f"{p}/{name}"], logical[f"{p}/{name}"] = arr(*shape), axes
    return tree, logical


def start(cmd: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline().strip()
    if not line.startswith("READY "):
        process.kill()
        raise RuntimeError(f"{cmd[:4]} did not start: {line!r}")
    return process, line.split(" ", 1)[1]


def start_param_server(storage: str, env: dict, *flags: str) -> tuple[subprocess.Popen, str]:
    """`rlax-tpu serve param-server` on loopback with persistent `storage` and K=3 (the
    benchmarks' server; tools/bench_trainer.py and bench_inference.py start theirs here too):
    (process, address). Stop it with `stop`."""
    command = [sys.executable, "-m", "rlax_tpu", "serve", "param-server", "--storage", storage]
    return start([*command, "--port", "0", "--hot-versions", "3", *flags], env)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def raw_grpc_bytes_per_s(total: int, env: dict) -> dict[str, float]:
    """Bare gRPC on a server process started for this, one channel: REPEATS streams of
    `total` bytes from the server into an array (`pull`, like a pull) and REPEATS from the
    client into an array on the server (`publish`, each chunk a bytes copy of the source as
    a publish's messages are); best and first of each, bytes/s."""
    import grpc

    from rlax_tpu.rpc import MAX_MESSAGE_BYTES

    process, address = start([sys.executable, "-c", _RAW_SERVER, str(total), str(CHUNK_BYTES)], env)
    try:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        with grpc.insecure_channel(address, options=options) as channel:
            call = channel.unary_stream(RAW_METHOD, lambda b: b, lambda b: b)
            sink = channel.stream_unary(RAW_SINK, lambda b: b, lambda b: b)
            source = memoryview(np.ones(total, np.uint8))
            pulls, publishes = [], []
            for _ in range(REPEATS):
                out = np.empty(total, np.uint8)  # the pull also lands bytes in an array
                t0 = time.perf_counter()
                received = 0
                for data in call(b""):
                    out[received : received + len(data)] = np.frombuffer(data, np.uint8)
                    received += len(data)
                pulls.append(total / (time.perf_counter() - t0))
                assert received == total
                t0 = time.perf_counter()
                chunks = (bytes(source[o : o + CHUNK_BYTES]) for o in range(0, total, CHUNK_BYTES))
                assert int(sink(chunks)) == total
                publishes.append(total / (time.perf_counter() - t0))
            return {
                "pull": max(pulls),
                "pull_first": pulls[0],
                "publish": max(publishes),
                "publish_first": publishes[0],
            }
    finally:
        stop(process)


def bench_size(label: str, target_bytes: int, env: dict, storage: str) -> dict:
    tree, logical = model_tree(target_bytes)
    total = sum(a.nbytes for a in tree.values())
    token = env["RLAX_TPU_AUTH_TOKEN"]
    server, address = start_param_server(storage, env, "--chunk-bytes", str(CHUNK_BYTES))
    publishes, cold, warm = [], [], []
    try:
        client = TreeClient([address], auth_token=token, chunk_bytes=CHUNK_BYTES)
        for version in range(REPEATS + 1):
            # A new version's content (other bytes, so nothing is deduplicated anywhere).
            values = tree if version == 0 else {p: a + version for p, a in tree.items()}
            t0 = time.perf_counter()
            client.publish(version, values)
            t1 = time.perf_counter()
            client.pull_arrays(version)
            t2 = time.perf_counter()
            pulled = client.pull_arrays(version)
            t3 = time.perf_counter()
            publishes.append(t1 - t0)
            cold.append(t2 - t1)
            warm.append(t3 - t2)
            # Untimed: its storage copy, and older versions go (as in a run).
            client.wait_persisted([version])
            client.confirm("bench", version)
            client.garbage_collect(version)
        assert all(np.array_equal(pulled[p], values[p]) for p in tree), "pulled bytes differ"
        # A tensor-parallel-2 worker's share: half of each tensor-split array.
        split = split_dims_from_logical(
            logical,
            [
                ("heads", ("tensor",)),
                ("kv_heads", ("tensor",)),
                ("mlp", ("tensor",)),
                ("vocab", ("tensor",)),
            ],
        )
        sharded = {p: d for p, d in split.items() if d is not None}
        wanted = {}
        for path, dim in sharded.items():
            box = list(layout.full_box(tree[path].shape))
            box[dim] = (0, tree[path].shape[dim] // 2)
            wanted[path] = [tuple(box)]
        before = client.bytes_pulled
        client.pull_boxes(REPEATS, wanted)
        shard_bytes = client.bytes_pulled - before
        full_sharded = sum(tree[p].nbytes for p in sharded)
        client.close()
    finally:
        stop(server)
    raw = raw_grpc_bytes_per_s(total, env)
    src = np.concatenate([a.reshape(-1).view(np.uint8) for a in tree.values()])
    dst = np.empty_like(src)
    memcpy = 0.0
    for _ in range(3):  # the first copy also pays for faulting in dst's pages
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy = max(memcpy, total / (time.perf_counter() - t0))
    # Version 0 is the fresh server's; versions 1.. are the steady state.
    publish, first_pull, pull = (total / min(times[1:]) for times in (publishes, cold, warm))
    return {
        "label": label,
        "bytes": total,
        "publish_bytes_per_s": publish,
        "raw_publish_bytes_per_s": raw["publish"],
        "publish_vs_raw_grpc": publish / raw["publish"],
        "first_pull_bytes_per_s": first_pull,
        "pull_bytes_per_s": pull,
        "raw_grpc_bytes_per_s": raw["pull"],
        "cold_pull_vs_raw_grpc": first_pull / raw["pull"],
        "pull_vs_raw_grpc": pull / raw["pull"],
        "first_publish_bytes_per_s": total / publishes[0],
        "raw_publish_first_bytes_per_s": raw["publish_first"],
        "first_version_pull_bytes_per_s": total / cold[0],
        "raw_grpc_first_bytes_per_s": raw["pull_first"],
        "memcpy_bytes_per_s": memcpy,
        "pull_vs_memcpy": pull / memcpy,
        "sharded_pull_bytes_fraction": shard_bytes / full_sharded,
    }


def small_tree(arrays: int, total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`arrays` float32 matrices [rows, 64] of about `total_bytes` in all."""
    rng = np.random.default_rng(seed)
    rows = max(1, total_bytes // 4 // 64 // arrays)
    return {
        f"layers/{i}/w": rng.standard_normal((rows, 64), dtype=np.float32) for i in range(arrays)
    }


def bench_small(arrays: int, env: dict, storage: str) -> dict:
    """Median publish, cold (first) pull and warm pull of a small tree, version by version,
    on a fresh server (as a small run's trainer and worker see them)."""
    tree = small_tree(arrays, SMALL_BYTES)
    token = env["RLAX_TPU_AUTH_TOKEN"]
    server, address = start_param_server(storage, env, "--chunk-bytes", str(CHUNK_BYTES))
    publish, first, warm = [], [], []
    try:
        client = TreeClient([address], auth_token=token, chunk_bytes=CHUNK_BYTES)
        for version in range(SMALL_REPEATS + 1):
            t0 = time.perf_counter()
            client.publish(version, tree)
            t1 = time.perf_counter()
            client.pull_arrays(version)
            t2 = time.perf_counter()
            client.pull_arrays(version)
            t3 = time.perf_counter()
            client.confirm("bench", version)  # as a worker does: older versions may go
            if version:  # the first version also pays for the channel and the server's warm-up
                publish.append(t1 - t0)
                first.append(t2 - t1)
                warm.append(t3 - t2)
        client.close()
    finally:
        stop(server)
    return {
        "arrays": arrays,
        "bytes": int(sum(a.nbytes for a in tree.values())),
        "repeats": SMALL_REPEATS,
        "publish_s": statistics.median(publish),
        "first_pull_s": statistics.median(first),
        "pull_s": statistics.median(warm),
    }


def bench_demo_load(env: dict, storage: str) -> dict:
    """Median publish and load of bench_e2e --quick's model, version by version: publish
    from device arrays in the published dtype (as the trainer does, after its cast), then a
    pull onto the device with the worker's shardings (a worker's load, without the engine's
    swap)."""
    import bench_e2e  # tools/bench_e2e.py: the demo model of its --quick runs
    import jax
    from flax import nnx

    from rlax_tpu.config import load_config
    from rlax_tpu.models import Transformer

    demo = [o for o in bench_e2e.QUICK if o.startswith("model.")]
    served = load_config(str(ROOT / "configs" / "tiny_cpu.py"), demo).model.served()
    params = nnx.to_pure_dict(nnx.state(Transformer(served, rngs=nnx.Rngs(0)), nnx.Param))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), params)
    token = env["RLAX_TPU_AUTH_TOKEN"]
    server, address = start_param_server(storage, env, "--chunk-bytes", str(CHUNK_BYTES))
    publish, load = [], []
    try:
        client = TreeClient([address], auth_token=token, chunk_bytes=CHUNK_BYTES)
        for version in range(SMALL_REPEATS + 1):
            values = jax.block_until_ready(jax.tree.map(lambda a, v=version: a + v, params))
            t0 = time.perf_counter()
            client.publish(version, values)
            t1 = time.perf_counter()
            jax.block_until_ready(client.pull(version, like))
            t2 = time.perf_counter()
            client.wait_persisted([version])  # untimed, as between a run's steps
            client.confirm("bench", version)
            client.garbage_collect(version)
            if version:  # the first also pays for the channel and the server's warm-up
                publish.append(t1 - t0)
                load.append(t2 - t1)
        client.close()
    finally:
        stop(server)
    leaves = jax.tree.leaves(params)
    return {
        "arrays": len(leaves),
        "bytes": int(sum(a.nbytes for a in leaves)),
        "repeats": SMALL_REPEATS,
        "publish_ms": 1e3 * statistics.median(publish),
        "load_ms": 1e3 * statistics.median(load),
        "publish_load_ms": 1e3
        * statistics.median(p + q for p, q in zip(publish, load, strict=True)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~100 MB only")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--storage", help="persistent storage of the server (default: a tmp dir)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the demo model's arrays (bench_demo_load)
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=secrets.token_hex(16), JAX_PLATFORMS="cpu")
    sizes = [("100MB", 100 * 2**20)] + ([] if args.quick else [("1GB", 2**30)])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, size in sizes:
            storage = args.storage or os.path.join(tmp, label)
            results.append(bench_size(label, size, env, storage))
        small = [bench_small(n, env, os.path.join(tmp, f"small{n}")) for n in SMALL_TREES]
        demo = bench_demo_load(env, os.path.join(tmp, "demo"))
    mb = 2**20
    print(
        f"{'tree':>6} {'MB':>5} {'publish':>8} {'raw pub':>8} {'pub/raw':>8} {'pull 1st':>9} "
        f"{'pull':>6} {'raw':>6} {'1st/raw':>8} {'pull/raw':>9} {'memcpy':>7} {'TP2 bytes':>10}"
    )
    for r in results:
        print(
            f"{r['label']:>6} {r['bytes'] / mb:5.0f} {r['publish_bytes_per_s'] / mb:8.0f} "
            f"{r['raw_publish_bytes_per_s'] / mb:8.0f} {r['publish_vs_raw_grpc']:8.2f} "
            f"{r['first_pull_bytes_per_s'] / mb:9.0f} {r['pull_bytes_per_s'] / mb:6.0f} "
            f"{r['raw_grpc_bytes_per_s'] / mb:6.0f} {r['cold_pull_vs_raw_grpc']:8.2f} "
            f"{r['pull_vs_raw_grpc']:9.2f} {r['memcpy_bytes_per_s'] / mb:7.0f} "
            f"{r['sharded_pull_bytes_fraction']:10.3f}"
        )
    print(
        f"MB/s, best of {REPEATS} new versions after the first. publish: a new version "
        "(storage written after it, untimed);\nraw pub: a bare client-streaming call of the "
        "same bytes; pull 1st: a version's first pull, right after its publish;\npull: its "
        "second; raw: a bare server-streaming call of the same bytes. TP2 bytes = bytes a "
        "tensor-parallel-2\nshard pull moves / its arrays' bytes."
    )
    for r in results:
        print(
            f"{r['label']:>6} version 0 on a fresh server: publish "
            f"{r['first_publish_bytes_per_s'] / mb:.0f} MB/s (raw "
            f"{r['raw_publish_first_bytes_per_s'] / mb:.0f}), first pull "
            f"{r['first_version_pull_bytes_per_s'] / mb:.0f} (raw "
            f"{r['raw_grpc_first_bytes_per_s'] / mb:.0f})"
        )
    print(
        f"{'small tree':>10} {'arrays':>6} {'KB':>5} {'publish ms':>10} "
        f"{'pull 1st ms':>11} {'pull ms':>8}"
    )
    for r in small:
        print(
            f"{'':>10} {r['arrays']:>6} {r['bytes'] / 1024:5.0f} {r['publish_s'] * 1e3:10.2f} "
            f"{r['first_pull_s'] * 1e3:11.2f} {r['pull_s'] * 1e3:8.2f}"
        )
    print(f"medians over {SMALL_REPEATS} versions, each published then pulled (1st) and again")
    print(
        f"demo model ({demo['arrays']} arrays, {demo['bytes'] / 1024:.0f} KB): publish "
        f"{demo['publish_ms']:.2f} ms + load {demo['load_ms']:.2f} ms = "
        f"{demo['publish_load_ms']:.2f} ms (publish_load_ms_small, median of the sums over "
        f"{demo['repeats']} versions)"
    )
    summary = dict(results[-1])
    summary["sizes"] = results
    summary["small"] = small
    summary["demo"] = demo
    summary["publish_load_ms_small"] = demo["publish_load_ms"]
    summary["mfu"] = None
    summary["mfu_note"] = "no model compute: publishes and pulls of parameter bytes only"
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
