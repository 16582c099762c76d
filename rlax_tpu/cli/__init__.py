"""The `rlax-tpu` command line: one entry point for every job and component.

`run` / `resume` (the RL job, launch/job.py), `sft` and `eval` (the warm start alone
and held-out accuracy, cli/sft_eval.py), `serve` (one component), `config show`,
`deploy gke|xmanager` (rlax_tpu/deploy), `simulate` (cli/simulate.py), `compile`
(cli/compile.py: the config's programs compiled for its TPU topology), `prefilter`
(cli/prefilter.py over launch/prefilter.py), `export` (cli/export.py: a run's checkpoint as
a Hugging Face model), `samples` (cli/samples.py: a batch of the rollout log as text) and `bench`
(tools/bench_*.py, cli/bench.py).
The parser reads only the config here; each command imports JAX and its component itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from rlax_tpu.config import ConfigError, RunConfig, field_descriptions, load_config
from rlax_tpu.storage import StorageUnreachableError

# Command -> its help line.
_COMMANDS = {
    "run": "start a run from a config (the main job)",
    "resume": "resume a run from its run directory after preemption",
    "serve": "serve one component over gRPC (param-server, inference, trainer, verifier)",
    "sft": "the SFT warm start alone: train trainer.warm_start.steps, export to RUN_DIR/sft_model",
    "eval": "held-out greedy accuracy of the run's newest model (or --model DIR) by the verifiers",
    "export": "a run's newest checkpoint (or --step S, or a CHECKPOINT) as a Hugging Face model "
    "directory, tokenizer included (`export RUN_DIR|CHECKPOINT OUT`)",
    "samples": "a batch of a run's rollout log: prompt, response text, reward, verdict "
    "(`samples RUN_DIR [--step S]`)",
    "config": "show the resolved config (`config show CONFIG [--set k=v ...]`)",
    "deploy": "a run's cluster jobs (`deploy gke|xmanager CONFIG [--set k=v ...]`)",
    "bench": "run a benchmark from the source checkout's tools/ (`bench NAME [ARGS ...]`)",
    "prefilter": "pass rates of a checkpoint on a dataset, and the rows within a band",
    "simulate": "simulate a run to size it: step time, idle, staleness (no JAX)",
    "compile": "compile every program for the config's TPU topology on this host: per-chip "
    "memory, FLOPs, fit",
}
# `serve COMPONENT`: the module whose main(args) serves it.
_SERVERS = {
    "param-server": "rlax_tpu.param_server.server",
    "inference": "rlax_tpu.inference.server",
    "trainer": "rlax_tpu.trainer.server",
    "verifier": "rlax_tpu.verifiers.server",
}
COMPONENTS = tuple(_SERVERS)
# Where a run's own failures come from (a component died, no usable snapshot, a bad
# dataset, ...): `main` ends them with their message, not a traceback.
_RUN_ERROR_PACKAGES = ("rlax_tpu.controller.", "rlax_tpu.launch.", "rlax_tpu.data.")


def _add_config_args(parser: argparse.ArgumentParser, *, optional: bool = False) -> None:
    parser.add_argument(
        "config",
        nargs="?" if optional else None,
        help="configs/*.py file with get_config(), or a config.json",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set trainer.optimizer.learning_rate=1e-6 "
        "or --set staleness=one_step_off_policy (repeatable, applied in order)",
    )


def _add_param_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `serve param-server`; they override the config (rlax_tpu.param_server.server)."""
    group = parser.add_argument_group("param-server")
    group.add_argument(
        "--storage",
        metavar="URL",
        help="persistent copy of every version: a directory, file:// or gs:// URL "
        "(default with a CONFIG: {storage.run_dir}/params)",
    )
    group.add_argument(
        "--memory-only",
        action="store_true",
        help="keep versions in memory only (tests, benchmarks): nothing survives a restart",
    )
    group.add_argument("--host", help="address to bind (default: param_server.host, 127.0.0.1)")
    group.add_argument("--port", type=int, default=0, help="port to bind (default 0: any free)")
    group.add_argument(
        "--hot-versions", type=int, metavar="K", help="versions kept in memory (default N // η + 2)"
    )
    group.add_argument("--replica", type=int, default=0, metavar="I", help="this replica's index")
    group.add_argument("--num-replicas", type=int, metavar="R", help="replicas in total")
    group.add_argument("--chunk-bytes", type=int, metavar="B", help="bytes per streamed chunk")


def _add_inference_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `serve inference` (rlax_tpu.inference.server); --host/--port are shared."""
    group = parser.add_argument_group("inference")
    group.add_argument(
        "--param-server",
        action="append",
        default=[],
        metavar="ADDR",
        help="host:port of a parameter-server replica to pull weights from (repeat for each "
        "replica, in replica order)",
    )
    group.add_argument(
        "--worker-id",
        metavar="ID",
        help="this worker's stable name, as reported by Health and as its consumer name on "
        "the parameter server (default inference_worker-0; give each worker its own)",
    )


def _add_verifier_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `serve verifier` (rlax_tpu.verifiers.server); --host/--port/--worker-id are
    shared (--worker-id names the verifier instance, default verifier-0)."""
    group = parser.add_argument_group("verifier")
    group.add_argument(
        "--num-workers",
        type=int,
        metavar="N",
        help="worker processes (default verifiers.num_workers)",
    )
    group.add_argument(
        "--max-tasks-per-worker",
        type=int,
        metavar="N",
        help="a worker process is replaced after this many tasks (default 100)",
    )
    group.add_argument(
        "--max-parallel-tests",
        type=int,
        metavar="N",
        help="test cases of one code request run at once (default 4)",
    )
    group.add_argument(
        "--queue-size",
        type=int,
        metavar="N",
        help="requests admitted (waiting + running) at once; a batch over it is refused with "
        "RESOURCE_EXHAUSTED (default 1024)",
    )
    group.add_argument(
        "--deadline-s",
        type=float,
        metavar="S",
        help="a batch's deadline when the caller names none (default 600)",
    )
    group.add_argument(
        "--results-cache",
        type=int,
        metavar="N",
        help="finished results kept by request id for retries (default 10000)",
    )
    group.add_argument(
        "--test-data-cache",
        metavar="DIR",
        help="where code problems fetched from the test-data repository are kept "
        "(default $XDG_CACHE_HOME/rlax_tpu/test_data)",
    )
    group.add_argument(
        "--test-data-root",
        action="append",
        default=[],
        metavar="URL",
        help="accept problem links only into this test-data repository (repeatable; "
        "default: any link of the form ROOT/problems/ID)",
    )


def _add_connect_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `run --connect` (rlax_tpu.launch.remote): where the components run."""
    group = parser.add_argument_group("connect")
    group.add_argument(
        "--connect",
        action="store_true",
        help="run only the controller, driving components already running elsewhere (GKE, "
        "XManager) at the addresses below (an SFT warm start runs on that trainer)",
    )
    for flag, env, many, what in (
        ("--param-server", "RLAX_TPU_PARAM_SERVER", True, "a parameter-server replica"),
        ("--trainer", "RLAX_TPU_TRAINER", False, "the trainer (its process 0)"),
        ("--inference", "RLAX_TPU_INFERENCE", True, "an inference worker"),
        ("--verifier", "RLAX_TPU_VERIFIER", True, "a verifier service"),
    ):
        more = " (repeat for each, in order)" if many else ""
        group.add_argument(
            flag,
            action="append" if many else "store",
            default=[] if many else None,
            metavar="ADDR",
            help=f"host:port of {what}{more}; default: ${env}"
            + (", comma-separated" if many else ""),
        )
    group.add_argument(
        "--connect-timeout-s",
        type=float,
        default=1800.0,
        metavar="S",
        help="how long to wait for every component to answer (default 1800)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlax-tpu",
        description="JAX RL post-training for LLMs on TPU pods, GPUs and CPUs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("run", "sft", "eval"):
            _add_config_args(p)
            if name == "eval":
                from rlax_tpu.cli.sft_eval import add_eval_args

                add_eval_args(p)
            if name == "run":
                p.add_argument(
                    "--smoke",
                    action="store_true",
                    help="instead of the run: check the model's numerics across the meshes "
                    "(sharded forward + gradient; trainer log-probs == inference log-probs)",
                )
                p.add_argument(
                    "--trial",
                    action="store_true",
                    help="a CPU trial of the recipe: its model, data and algorithm, with the "
                    "accelerator settings, batch, lengths, KV pool and steps shrunk to what a "
                    "CPU runs in minutes (each change printed; --set wins), in <run_dir>_trial",
                )
                _add_connect_args(p)
        elif name == "resume":
            p.add_argument("run_dir", help="the run directory (local path or gs://)")
        elif name == "serve":
            p.add_argument("component", choices=COMPONENTS)
            p.add_argument(
                "--stopped-exit-code",
                type=int,
                default=0,
                metavar="N",
                help="exit with N after a stop by SIGTERM/SIGINT (default 0). The GKE pods of "
                "replaceable components use 143, so that a stopped server is a failed pod, "
                "which its Job replaces, not a completed one (docs/deploy.md)",
            )
            _add_config_args(p, optional=True)
            _add_param_server_args(p)
            _add_inference_args(p)
            _add_verifier_args(p)
        elif name == "config":
            action = p.add_subparsers(dest="action", metavar="ACTION", required=True)
            show = action.add_parser(
                "show",
                help="print the effective config: the algorithm with its preset's values "
                "filled in, unset (null or empty) fields hidden",
            )
            _add_config_args(show, optional=True)
            show.add_argument("--format", choices=("text", "json"), default="text")
            show.add_argument(
                "--all", action="store_true", help="every field, the unset ones included"
            )
            show.add_argument(
                "--help-fields",
                action="store_true",
                help="every field of a config (no CONFIG needed): path, type, default and "
                "what it is, one line each",
            )
        elif name == "deploy":
            target = p.add_subparsers(dest="target", metavar="TARGET", required=True)
            gke = target.add_parser("gke", help="GKE JobSet manifests (docs/deploy.md)")
            _add_config_args(gke)
            gke.add_argument(
                "--out", metavar="DIR", help="write DIR/<config name>.yaml (default: stdout)"
            )
            gke.add_argument(
                "--name", help="the run's name on the cluster (default: the config's name)"
            )
            xm = target.add_parser(
                "xmanager", help="XManager jobs of the same processes (docs/deploy.md)"
            )
            _add_config_args(xm)
            from rlax_tpu.deploy.xmanager import add_args as add_xmanager_args

            add_xmanager_args(xm)
        elif name == "simulate":
            from rlax_tpu.cli.simulate import add_args as add_simulate_args

            _add_config_args(p)
            add_simulate_args(p)
        elif name == "compile":
            from rlax_tpu.cli.compile import add_args as add_compile_args

            _add_config_args(p)
            add_compile_args(p)
        elif name == "prefilter":
            from rlax_tpu.cli.prefilter import add_args as add_prefilter_args

            _add_config_args(p)
            add_prefilter_args(p)
        elif name == "export":
            from rlax_tpu.cli.export import add_args as add_export_args

            add_export_args(p)
        elif name == "samples":
            from rlax_tpu.cli.samples import add_args as add_samples_args

            add_samples_args(p)
        elif name == "bench":
            from rlax_tpu.cli.bench import add_args as add_bench_args

            add_bench_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # gcsfs logs its last retry's error with a traceback; the storage API reports it as
    # StorageUnreachableError, said below in one line.
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    try:
        return _dispatch(args)
    except ConfigError as e:
        print(f"rlax-tpu: config error: {e}", file=sys.stderr)
        return 2
    except StorageUnreachableError as e:
        print(f"rlax-tpu {args.command}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        # The run's own failures (a component died or stayed unreachable, no usable
        # snapshot, ...) end with their message, not a traceback; anything else is a bug
        # and keeps its traceback.
        from rlax_tpu.launch.launcher import ComponentFailed
        from rlax_tpu.rpc.client import RpcCallError

        if type(e).__module__.startswith(_RUN_ERROR_PACKAGES) or isinstance(e, RpcCallError):
            print(f"rlax-tpu {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
            # A component that failed or stayed unreachable loses nothing: say how to go on.
            if args.command in ("run", "resume") and isinstance(e, RpcCallError | ComponentFailed):
                run_dir = getattr(e, "run_dir", "") or "RUN_DIR"
                print(
                    "the run directory keeps everything up to its last snapshot: "
                    f"`rlax-tpu resume {run_dir}` continues from there",
                    file=sys.stderr,
                )
            return 1
        raise


def _unset(line: str) -> bool:
    """Whether a `key = value` line of `to_text` holds no value (null or empty)."""
    return line.partition(" = ")[2] in ("null", '""', "[]", "{}")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "config":
        if args.help_fields:
            for path, hint, default, text in field_descriptions(RunConfig):
                print(f"{path} ({hint}) = {default}: {text}")
            return 0
        if args.config is None:
            raise ConfigError("config show needs a CONFIG (configs/*.py or a config.json)")
        config = load_config(args.config, args.overrides)
        if args.format == "json":  # the config as given (it loads back as it is)
            print(json.dumps(config.to_dict(), indent=2))
            return 0
        algorithm = config.trainer.algorithm
        effective = dataclasses.replace(
            config, trainer=dataclasses.replace(config.trainer, algorithm=algorithm.resolved())
        )
        lines = effective.to_text().splitlines()
        shown = lines if args.all else [line for line in lines if not _unset(line)]
        sys.stdout.write("".join(line + "\n" for line in shown))
        print(f"# trainer.algorithm: preset {algorithm.name!r}, its values filled in")
        if len(shown) < len(lines):
            print(f"# {len(lines) - len(shown)} unset fields (null or empty) hidden: --all")
        print(f"# paradigm: {config.staleness.paradigm}; digest: {config.digest()}")
        return 0
    if args.command == "run":
        from rlax_tpu.cli.run import run
        from rlax_tpu.models import CheckpointError

        if args.trial:  # sized for the CPU before the checkpoint's architecture is read
            from rlax_tpu.cli.trial import memory_note, trial

            user_set = [item.partition("=")[0].strip() for item in args.overrides]
            config = load_config(args.config, args.overrides, resolve=False)
            config, changes = trial(config, user_set)
            print(f"trial of {args.config} on this host: {len(changes)} settings changed")
            for line in changes:
                print(f"  {line}")
            note = memory_note(config)
            if note:
                print(note)
        else:
            config = load_config(args.config, args.overrides)
        try:
            if args.smoke:
                return run(config)
            from rlax_tpu.launch.job import main as run_job
            from rlax_tpu.launch.wandb_logging import require_wandb

            require_wandb(config.logging)  # before anything starts

            if args.connect:
                from rlax_tpu.launch.remote import ComponentAddresses

                addresses = ComponentAddresses.resolve(
                    param_server=args.param_server,
                    trainer=args.trainer,
                    inference=args.inference,
                    verifier=args.verifier,
                    fallback={"verifier": config.verifiers.addresses()},
                )
                return run_job(config, addresses=addresses, ready_timeout_s=args.connect_timeout_s)
            if args.param_server or args.trainer or args.inference or args.verifier:
                print("rlax-tpu run: component addresses need --connect", file=sys.stderr)
                return 2
            return run_job(config)
        except (CheckpointError, FileNotFoundError) as e:
            print(f"rlax-tpu run: {e}", file=sys.stderr)
            return 2
    if args.command == "deploy":
        return _deploy(args)
    if args.command == "simulate":
        from rlax_tpu.cli.simulate import main as simulate

        return simulate(args)
    if args.command == "compile":
        from rlax_tpu.cli.compile import main as compile_main

        return compile_main(args)
    if args.command == "resume":
        from rlax_tpu.launch.job import resume

        return resume(args.run_dir)
    if args.command == "serve":
        # A server returns 0 only once it was told to stop.
        code = _serve(args)
        return args.stopped_exit_code if code == 0 else code
    if args.command == "sft":
        from rlax_tpu.cli.sft_eval import sft_main

        return sft_main(args)
    if args.command == "eval":
        from rlax_tpu.cli.sft_eval import eval_main

        return eval_main(args)
    if args.command == "prefilter":
        from rlax_tpu.cli.prefilter import main as prefilter

        return prefilter(load_config(args.config, args.overrides), args)
    if args.command == "export":
        from rlax_tpu.cli.export import main as export

        return export(args)
    if args.command == "samples":
        from rlax_tpu.cli.samples import main as samples

        return samples(args)
    if args.command == "bench":
        from rlax_tpu.cli.bench import main as bench

        return bench(args)
    raise AssertionError(f"command {args.command!r} has no handler")


def _serve(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(_SERVERS[args.component]).main(args)


def _deploy(args: argparse.Namespace) -> int:
    """`rlax-tpu deploy gke`: the manifests to stdout or DIR/<config name>.yaml;
    `rlax-tpu deploy xmanager`: the XManager jobs' specs (--dry-run) or their launch."""
    from pathlib import Path

    from rlax_tpu.deploy import DeployError
    from rlax_tpu.deploy.gke import output_name, render

    if args.target == "xmanager":
        from rlax_tpu.deploy import xmanager

        try:
            xmanager.main(
                args.config,
                args.overrides,
                dry_run=args.dry_run,
                image=args.image,
                address_template=args.address_template,
                experiment_title=args.experiment_title,
            )
        except DeployError as e:
            print(f"rlax-tpu deploy {args.target}: {e}", file=sys.stderr)
            return 2
        return 0
    config = load_config(args.config, args.overrides)
    command = ["rlax-tpu", "deploy", args.target, args.config]
    command += [f"--set={o}" for o in args.overrides]
    command += [f"--name={args.name}"] if args.name else []
    try:
        text = render(config, command=command, name=args.name)
    except DeployError as e:
        print(f"rlax-tpu deploy {args.target}: {e}", file=sys.stderr)
        return 2
    if not args.out:
        sys.stdout.write(text)
        return 0
    path = Path(args.out) / output_name(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
