#!/usr/bin/env python3
"""Parameter-server throughput against a bare gRPC byte stream and an in-memory copy.

    python tools/bench_param_server.py [--quick] [--json OUT]

In one run: start a real parameter-server process and a bare gRPC streaming server
process on loopback; publish then pull a model-shaped tree of ~100 MB (and ~1 GB
without --quick) through the parameter server; stream the same bytes through the
bare server; copy them in memory; and pull one tensor-parallel-2 shard to measure the
bytes a sharded worker moves. Prints a table with ratios against the baselines.

Two pull figures, because the servicer keeps the serialized chunks of the newest version
pulled (its pull cache, `param_server.pull_cache_bytes`):

* `first_pull_*`: the first pull of the version, right after its publish, on a fresh
  server. Cold: the server reads every box from the store and serializes it (filling the
  pull cache). This is what the first worker to load a version gets.
* `pull_*` (the headline): the best of the later pulls, served from the pull cache. This
  is what every further worker pulling the same version gets.

And two raw gRPC baselines: `raw_grpc_bytes_per_s`, the best of REPEATS streams of the
same bytes on one channel (warm), and `raw_grpc_first_bytes_per_s`, the first stream on
a fresh server process and channel, which pays the same one-time costs as a first pull
(gRPC flow-control windows that grow with traffic, memory touched for the first time).
`first_pull_vs_raw_grpc_first` compares like with like.

And the latency of a tiny model's version (`small`): trees of <1 MB in 8 and 32 arrays,
each published as a new version, pulled once right after (cold, as the one worker of a small
run pulls every version) and once more (warm), many times; medians. For such a tree the
bytes take almost no time: what is left is the fixed cost per version and per array that
the 100 MB and 1 GB rates cannot show (tools/validate_simulator.py calibrates the
simulator's publish_fixed_s / pull_fixed_s and their per-array terms from it).
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

from rlax_tpu.param_server import layout  # noqa: E402
from rlax_tpu.param_server.client import (  # noqa: E402
    ParamServerClient,
    split_dims_from_logical,
)

CHUNK_BYTES = 4 * 2**20
REPEATS = 5  # throughputs are the best of this many runs (a 2-core machine is noisy)
RAW_METHOD = "/bench.Raw/Stream"
SMALL_TREES = (8, 32)  # arrays in a tiny-model-shaped tree of SMALL_BYTES
SMALL_BYTES = 2**19
SMALL_REPEATS = 40  # versions published and pulled per small tree (medians)

_RAW_SERVER = r"""
import sys, grpc
from concurrent import futures
from rlax_tpu.rpc import MAX_MESSAGE_BYTES
total, chunk = int(sys.argv[1]), int(sys.argv[2])
payload = bytes(chunk)
def stream(request, context):
    for offset in range(0, total, chunk):
        yield payload[: min(chunk, total - offset)]
handler = grpc.method_handlers_generic_handler(
    "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=lambda b: b, response_serializer=lambda b: b)})
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


def raw_grpc_bytes_per_s(total: int, env: dict) -> tuple[float, float]:
    """(best of REPEATS streams of `total` bytes, the first of them) through a bare gRPC
    server process started for this, on one channel."""
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
            rates = []
            for _ in range(REPEATS):
                out = np.empty(total, np.uint8)  # the pull also lands bytes in an array
                t0 = time.perf_counter()
                received = 0
                for data in call(b""):
                    out[received : received + len(data)] = np.frombuffer(data, np.uint8)
                    received += len(data)
                rates.append(total / (time.perf_counter() - t0))
                assert received == total
            return max(rates), rates[0]
    finally:
        stop(process)


def bench_size(label: str, target_bytes: int, env: dict, storage: str) -> dict:
    tree, logical = model_tree(target_bytes)
    total = sum(a.nbytes for a in tree.values())
    token = env["RLAX_TPU_AUTH_TOKEN"]
    server, address = start_param_server(storage, env, "--chunk-bytes", str(CHUNK_BYTES))
    try:
        client = ParamServerClient([address], auth_token=token, chunk_bytes=CHUNK_BYTES)
        t0 = time.perf_counter()
        client.publish(0, tree)
        publish_s = time.perf_counter() - t0
        pulls = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            pulled = client.pull_arrays(0)
            pulls.append(time.perf_counter() - t0)
        assert all(np.array_equal(pulled[p], tree[p]) for p in tree), "pulled bytes differ"
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
        client.pull_boxes(0, wanted)
        shard_bytes = client.bytes_pulled - before
        full_sharded = sum(tree[p].nbytes for p in sharded)
        client.close()
    finally:
        stop(server)
    raw, raw_first = raw_grpc_bytes_per_s(total, env)
    src = np.concatenate([a.reshape(-1).view(np.uint8) for a in tree.values()])
    dst = np.empty_like(src)
    memcpy = 0.0
    for _ in range(3):  # the first copy also pays for faulting in dst's pages
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy = max(memcpy, total / (time.perf_counter() - t0))
    # Later pulls are served from the servicer's pull cache: what every further worker gets.
    pull = total / min(pulls[1:])
    # The first pull of a version reads it from the store and serializes it (cold).
    first_pull = total / pulls[0]
    return {
        "label": label,
        "bytes": total,
        "publish_bytes_per_s": total / publish_s,
        "pull_bytes_per_s": pull,
        "raw_grpc_bytes_per_s": raw,
        "memcpy_bytes_per_s": memcpy,
        "pull_vs_raw_grpc": pull / raw,
        "first_pull_bytes_per_s": first_pull,
        "first_pull_vs_raw_grpc": first_pull / raw,
        "raw_grpc_first_bytes_per_s": raw_first,
        "first_pull_vs_raw_grpc_first": first_pull / raw_first,
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
        client = ParamServerClient([address], auth_token=token, chunk_bytes=CHUNK_BYTES)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~100 MB only")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--storage", help="persistent storage of the server (default: a tmp dir)")
    args = parser.parse_args()
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=secrets.token_hex(16), JAX_PLATFORMS="cpu")
    sizes = [("100MB", 100 * 2**20)] + ([] if args.quick else [("1GB", 2**30)])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, size in sizes:
            storage = args.storage or os.path.join(tmp, label)
            results.append(bench_size(label, size, env, storage))
        small = [bench_small(n, env, os.path.join(tmp, f"small{n}")) for n in SMALL_TREES]
    mb = 2**20
    print(
        f"{'tree':>6} {'MB':>5} {'publish':>8} {'pull 1st':>9} {'pull':>6} {'raw 1st':>8} "
        f"{'raw':>6} {'memcpy':>7} {'pull/raw':>9} {'1st/raw':>8} {'1st/raw 1st':>12} "
        f"{'TP2 bytes':>10}"
    )
    for r in results:
        print(
            f"{r['label']:>6} {r['bytes'] / mb:5.0f} {r['publish_bytes_per_s'] / mb:8.0f} "
            f"{r['first_pull_bytes_per_s'] / mb:9.0f} {r['pull_bytes_per_s'] / mb:6.0f} "
            f"{r['raw_grpc_first_bytes_per_s'] / mb:8.0f} {r['raw_grpc_bytes_per_s'] / mb:6.0f} "
            f"{r['memcpy_bytes_per_s'] / mb:7.0f} {r['pull_vs_raw_grpc']:9.2f} "
            f"{r['first_pull_vs_raw_grpc']:8.2f} {r['first_pull_vs_raw_grpc_first']:12.2f} "
            f"{r['sharded_pull_bytes_fraction']:10.3f}"
        )
    print(
        "MB/s. pull 1st = first pull of the version (cold: read from the store, serialized);\n"
        f"pull = best of the {REPEATS - 1} later pulls, served from the servicer's pull cache "
        "(pull_bytes_per_s);\n"
        f"raw = best of {REPEATS} bare gRPC streams of the same bytes on one channel; "
        "raw 1st = the first of them\n(fresh server and channel, like pull 1st). "
        "TP2 bytes = bytes a tensor-parallel-2 shard pull moves / its arrays' bytes."
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
    summary = dict(results[-1])
    summary["sizes"] = results
    summary["small"] = small
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
