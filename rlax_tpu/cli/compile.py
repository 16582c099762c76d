"""`rlax-tpu compile CONFIG`: prove a config fits its TPU topology, on any host.

Compiles every program the run executes on its accelerators with libtpu's compiler for the
trainer's and the inference workers' topologies (rlax_tpu.compile); a component on GPUs
(`trainer.gpu` / `inference.gpu`) is compiled by XLA:GPU with --on-gpu on a GPU machine,
else by XLA:CPU for as many CPU devices (an estimate, labelled so). It prints per-chip memory
against HBM, FLOPs, bytes and roofline times and an inference worker's KV capacity (tokens,
and concurrent sequences under each admission at the config's expected lengths:
rlax_tpu.inference.capacity), and exits 1 when a program does not fit
(more than 90% of a chip's HBM, or the compiler runs out of it), naming the biggest consumer
and the config knobs that shrink it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rlax_tpu.config import load_config


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", dest="json_out", metavar="OUT", help="write the report here")
    parser.add_argument(
        "--programs",
        metavar="NAMES",
        help="comma-separated subset of init, init_opt, rl_step, recompute, sft_step, publish, "
        "prefill, extend, decode, swap_out, swap_in (default: every program the run executes; "
        "sft_step only with trainer.warm_start.steps > 0, publish only when the served params "
        "differ, extend only with episodes or in_flight_update=keep)",
    )
    parser.add_argument(
        "--save-compiled",
        metavar="DIR",
        help="keep the compiled executables in DIR (local) with a manifest: a run with "
        "--set trainer.compiled_dir=DIR --set inference.compiled_dir=DIR on this topology "
        "loads them instead of compiling at start-up",
    )
    parser.add_argument(
        "--find-max",
        metavar="KNOB",
        choices=("micro_batch", "max_seq_len"),
        help="bisect for the largest trainer.micro_batch_size (micro_batch: the divisors of "
        "the mini-batch) or trainer.max_seq_len (max_seq_len: multiples of 256) whose train "
        "programs fit, compiling each value probed, and print the --set to use",
    )
    parser.add_argument(
        "--on-gpu",
        action="store_true",
        help="compile the programs of a component on GPUs (trainer.gpu / inference.gpu) with "
        "this machine's GPUs (XLA:GPU, the cuda extra) instead of the XLA:CPU estimate",
    )


def main(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # config errors before JAX starts
    programs = None
    if args.programs:
        programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())
    from rlax_tpu.hardware import GiB, parse_gpu, prepare_environment

    gpus = [parse_gpu(s.gpu)[1] for s in (config.trainer, config.inference) if s.gpu]
    prepare_environment(cpu_devices=max(gpus, default=0), on_gpu=args.on_gpu)
    # The compiler flags the run's processes start with (one place: runtime.jax_environment).
    from rlax_tpu.runtime import jax_environment

    os.environ.update(jax_environment(dataclasses.replace(config, cpu_devices=0)))
    from rlax_tpu.compile import TopologyError, compile_config, format_report

    def progress(report) -> None:
        state = "error" if report.error else f"{report.total / GiB:.2f} GiB per chip"
        print(
            f"compiled {report.component} {report.name} in "
            f"{report.lower_s + report.compile_s:.1f} s: {state}",
            file=sys.stderr,
            flush=True,
        )

    print(f"rlax-tpu compile {config.name} (digest {config.digest()[:12]})", flush=True)
    if args.find_max:
        return _find_max(config, args.find_max, progress)
    try:
        report = compile_config(config, programs, progress=progress, save_dir=args.save_compiled)
    except (TopologyError, ValueError) as e:  # ValueError: an unknown program name
        print(f"rlax-tpu compile: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report.to_json(), f, indent=2)
            f.write("\n")
    if not report.fits:
        for problem in report.problems:
            print(f"rlax-tpu compile: {problem}", file=sys.stderr)
        return 1
    return 0


def _find_max(config, knob: str, progress) -> int:
    from rlax_tpu.compile import compile_config
    from rlax_tpu.compile.search import find_max

    def compile_programs(probe, programs):
        value = (
            probe.trainer.micro_batch_size if knob == "micro_batch" else probe.trainer.max_seq_len
        )
        print(f"probing {knob} = {value} ...", file=sys.stderr, flush=True)
        return compile_config(probe, programs, progress=progress)

    result = find_max(config, knob, compile_programs=compile_programs)
    for value, fits, why in result.tried:
        print(f"  {result.knob}={value}: " + ("fits" if fits else f"does not fit: {why}"))
    if result.best is None:
        print(
            f"rlax-tpu compile: no {result.knob} fits, not even {result.candidates[0]}",
            file=sys.stderr,
        )
        return 1
    print(f"largest {result.knob} that fits: {result.best}; use {result.set_flag}")
    return 0
