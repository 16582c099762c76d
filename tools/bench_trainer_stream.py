"""Stream one large TrainStep batch over loopback gRPC and report time and memory on each end.

The server is `TrainerServicer` (the real receiver and checks) in a child process, over a
stand-in trainer that only reports its process's peak RSS; the client is `TrainerClient`.
Default: a Llama-8B pod batch, 2048 × 16384 tokens (int32 tokens, bool mask, float32
behaviour log-probs: 302 MB), at several `trainer.max_message_bytes`.

    python tools/bench_trainer_stream.py [--rows 2048] [--seq 16384] [--steps 3]
        [--message-bytes 1048576 16777216]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

TOKEN = "bench"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def serve(limit: int, rows: int, seq: int) -> None:
    """The child: a trainer service whose trainer records nothing but its peak RSS."""
    from rlax_tpu.api.trainer import BatchLimits, StepResult
    from rlax_tpu.rpc import make_server
    from rlax_tpu.trainer.service import TrainerServicer

    class StandIn:
        step = 0

        def train_step(self, step, batch):
            return StepResult(step, step + 1, {"peak_rss_mib": _peak_rss_mib()})

    server, port = make_server("127.0.0.1", 0, auth_token=TOKEN, max_receive_bytes=limit)
    TrainerServicer(StandIn(), limits=BatchLimits(rows, seq)).add_to_server(server)
    server.start()
    print(f"READY 127.0.0.1:{port} {_peak_rss_mib():.0f}", flush=True)
    server.wait_for_termination()


def bench(limit: int, rows: int, seq: int, steps: int) -> dict:
    import numpy as np

    from rlax_tpu.api.trainer import RolloutArrays, TrainerClient

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(limit), "--rows", str(rows), "--seq", str(seq)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _, address, server_base = child.stdout.readline().split()
        rng = np.random.default_rng(0)
        batch = RolloutArrays(
            tokens=rng.integers(0, 128256, (rows, seq), dtype=np.int32),
            response_mask=np.ones((rows, seq), bool),
            group_ids=np.arange(rows, dtype=np.int32) // 16,
            rewards=np.zeros(rows, np.float32),
            behaviour_logprobs=np.full((rows, seq), -1.0, np.float32),
            versions=np.zeros(rows, np.int32),
        )
        size = sum(
            getattr(batch, name).nbytes
            for name in batch.__dataclass_fields__
            if getattr(batch, name) is not None
        )
        client_base = _peak_rss_mib()
        times, server_peak = [], 0.0
        with TrainerClient(address, auth_token=TOKEN, max_message_bytes=limit) as client:
            for step in range(steps):
                start = time.perf_counter()
                result = client.train_step(step, batch)
                times.append(time.perf_counter() - start)
                server_peak = result.metrics["peak_rss_mib"]
        return {
            "limit": limit,
            "mb": size / 1e6,
            "best_s": min(times),
            "worst_s": max(times),
            "server_mib": server_peak - float(server_base),
            "client_mib": _peak_rss_mib() - client_base,
            # A stand-in trainer receives the batch: bytes moved, no model compute to hold
            # against a peak.
            "mfu": None,
        }
    finally:
        child.terminate()
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--message-bytes", type=int, nargs="+", default=[2**20, 16 * 2**20])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.rows, args.seq)
        return
    # A fresh pair of processes each: peak RSS is per process.
    runs = [bench(limit, args.rows, args.seq, args.steps) for limit in args.message_bytes]
    base = runs[0]
    print(f"batch {base['mb']:.0f} MB, {args.steps} steps each; ratios against the first limit")
    print(
        f"{'max_message_bytes':>17} {'best s':>8} {'worst s':>8} {'× time':>7} "
        f"{'server +MiB':>12} {'client +MiB':>12} {'× server':>9}"
    )
    for r in runs:
        print(
            f"{r['limit']:>17} {r['best_s']:>8.2f} {r['worst_s']:>8.2f} "
            f"{r['best_s'] / base['best_s']:>7.2f} {r['server_mib']:>12.0f} "
            f"{r['client_mib']:>12.0f} {r['server_mib'] / max(base['server_mib'], 1):>9.2f}"
        )


if __name__ == "__main__":
    main()
