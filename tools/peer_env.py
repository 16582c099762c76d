#!/usr/bin/env python3
"""Build the environment the Tunix comparison of tools/bench_inference.py runs in.

google-tunix pins `safetensors<0.8` (ours is >=0.8) and pulls in training stacks the
sampler never imports; resolving it together with rlax_tpu makes pip backtrack to
ancient `transformers`. So it gets its own virtual environment: rlax_tpu with the `peer`
extra (the modules Tunix's sampler imports), then google-tunix itself without its
dependency pins. Then:

    python3 tools/peer_env.py                    # creates .venv-peer
    .venv-peer/bin/python tools/bench_inference.py --json OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNIX = "google-tunix==0.1.7"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-peer")
    args = parser.parse_args(argv)
    python = args.venv / "bin" / "python"
    if not python.exists():
        print(f"creating {args.venv}", flush=True)
        venv.EnvBuilder(with_pip=True).create(args.venv)

    def pip(*packages: str) -> None:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *packages], check=True)

    pip("-e", f"{ROOT}[peer]")
    pip("--no-deps", TUNIX)
    # Fails here, not in the middle of a benchmark, if the peer's imports drifted.
    subprocess.run([str(python), "-c", "from tunix.generate import sampler"], check=True)
    print(f"ready: {python} tools/bench_inference.py", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
