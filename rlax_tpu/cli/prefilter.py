"""`rlax-tpu prefilter`: its flags, and the command over launch/prefilter.py (which launches
the workers and verifiers; its imports load only when the command runs)."""

from __future__ import annotations

import argparse
import sys

from rlax_tpu.config import RunConfig


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `rlax-tpu prefilter` (the config and --set come from the caller)."""
    parser.add_argument("--dataset", required=True, help="JSONL or Parquet prompts (local, gs://)")
    parser.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--samples", type=int, default=8, help="K samples per prompt")
    parser.add_argument("--min-pass", type=float, default=0.1)
    parser.add_argument("--max-pass", type=float, default=0.9)
    parser.add_argument("--out", required=True, help="output directory (local or gs://)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="verifier of rows without a 'verifier' field (default: the config's first dataset's)",
    )
    parser.add_argument(
        "--work-dir", default=None, help="scratch run directory (default: a temporary one)"
    )


def main(config: RunConfig, args: argparse.Namespace) -> int:
    from rlax_tpu.launch.prefilter import Band, prefilter

    try:
        prefilter(
            config,
            dataset=args.dataset,
            checkpoint=args.checkpoint,
            samples=args.samples,
            band=Band(args.min_pass, args.max_pass),
            out=args.out,
            verifier=args.verifier,
            work_dir=args.work_dir,
        )
    except (ValueError, RuntimeError) as e:  # config, dataset, component or request errors
        print(f"rlax-tpu prefilter: {e}", file=sys.stderr)
        return 2
    return 0
