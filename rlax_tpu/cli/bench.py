"""`rlax-tpu bench NAME [ARGS...]`: run one of the benchmarks in the source checkout's tools/.

The benchmarks are scripts (tools/bench_NAME.py) rather than package modules: they start
real component processes and compare against peers, so they ship with the repository, not
with the wheel. This command finds them next to the package and runs one in a child
process with the arguments given, unchanged (`rlax-tpu bench trainer --quick --json o.json`).
`rlax-tpu bench device` is the one-command accelerator check (tools/device_check.py, through
its tools/bench_device.py name).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("param_server", "inference", "trainer", "verifier", "e2e", "device")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help=f"the benchmark: {', '.join(BENCHMARKS)} (none: list them)",
    )
    parser.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="passed to tools/bench_NAME.py unchanged (e.g. --quick --json OUT; --help)",
    )


def tools_dir() -> Path | None:
    """The source checkout's tools/ directory, or None when the package was installed from a
    wheel (then there is no checkout next to it)."""
    import rlax_tpu

    tools = Path(rlax_tpu.__file__).resolve().parents[1] / "tools"
    return tools if (tools / "bench_trainer.py").is_file() else None


def summary(script: Path) -> str:
    """The first clause of a benchmark script's docstring (the script is not imported)."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    for end in (": ", ". ", ", and "):
        first = first.split(end, 1)[0]
    return first.rstrip(".")


def main(args: argparse.Namespace) -> int:
    tools = tools_dir()
    if tools is None:
        print(
            "rlax-tpu bench: the benchmarks ship with the source repository (tools/bench_*.py), "
            "not with the installed package; clone the repository, install it with "
            "`pip install -e .` and run `rlax-tpu bench` from there",
            file=sys.stderr,
        )
        return 2
    if args.name is None:
        print("benchmarks (rlax-tpu bench NAME [ARGS...]; NAME --help for its options):")
        for name in BENCHMARKS:
            script = tools / f"bench_{name}.py"
            print(f"  {name:<13} {summary(script) if script.is_file() else '(missing)'}")
        return 0
    name = args.name.replace("-", "_")
    script = tools / f"bench_{name}.py"
    if name not in BENCHMARKS or not script.is_file():
        print(
            f"rlax-tpu bench: unknown benchmark {args.name!r}; choose one of "
            f"{', '.join(BENCHMARKS)} (`rlax-tpu bench` lists them)",
            file=sys.stderr,
        )
        return 2
    try:
        return subprocess.call([sys.executable, str(script), *args.args])
    except KeyboardInterrupt:  # the child got the same Ctrl-C and stops on its own
        return 130
