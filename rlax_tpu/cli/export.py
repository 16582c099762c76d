"""`rlax-tpu export RUN_DIR|CHECKPOINT OUT`: a run's policy as a Hugging Face model directory
(weights, config.json, the tokenizer's files, generation_config.json: models/export.py).

What is exported: the run's newest loadable RL checkpoint (RUN_DIR/checkpoints), the one of
`--step S`, or the checkpoint directory named (RUN_DIR/checkpoints/S); a run with no RL
checkpoint exports its SFT warm start's (RUN_DIR/checkpoints_warm_start). Checkpoints are
restored by the trainer's own store (rlax_tpu/checkpoints.py), so one whose save did not
finish, or whose arrays do not match their checksums, is never exported; but onto one CPU
device, without the trainer service or the run's devices. The run's config is its
effective_config.json (the config its trainer ran, with the tokenizer directory
materialised), else its config.json.

A LoRA run (model.lora) is written as PEFT loads it: OUT is a PEFT adapter directory and
OUT/base the base model it applies to (models/export.py, `export_peft`); `--merged` writes
instead one plain model directory with the adapters folded into the base.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Literal

from rlax_tpu import storage
from rlax_tpu.config import ConfigError, RunConfig
from rlax_tpu.run_dir import (
    CHECKPOINTS,
    CONFIG_FILE,
    DIGEST_FILE,
    TOKENIZER,
    WARM_START_CHECKPOINTS,
)

Kind = Literal["rl", "warm_start"]
_KINDS: dict[str, Kind] = {CHECKPOINTS: "rl", WARM_START_CHECKPOINTS: "warm_start"}


class ExportError(Exception):
    """The export cannot run as asked; the message says why and what to give instead."""


@dataclasses.dataclass(frozen=True)
class ExportSource:
    """Where the weights come from: `run_dir`, and which of its checkpoints (kind None: the
    newest RL checkpoint, else the warm start's; step None: the newest that loads)."""

    run_dir: str
    kind: Kind | None = None
    step: int | None = None


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="RUN_DIR|CHECKPOINT",
        help="a run directory (local or gs://), or one checkpoint in it "
        f"(RUN_DIR/{CHECKPOINTS}/STEP or RUN_DIR/{WARM_START_CHECKPOINTS}/STEP)",
    )
    parser.add_argument("out", metavar="OUT", help="the model directory to write (local or gs://)")
    parser.add_argument(
        "--step",
        type=int,
        metavar="S",
        help="export the RL checkpoint of step S (default: the newest one that loads)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the tokenizer directory whose files go with the model (default: the run's)",
    )
    parser.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: fold the adapters into the base (W + alpha/rank·A·B) and write one "
        "plain model directory instead of a PEFT adapter and its base",
    )


def main(args: argparse.Namespace) -> int:
    """`rlax-tpu export`: exit 0 with the export written, 2 with one line saying why not."""
    from rlax_tpu.checkpoints import NoValidCheckpointError
    from rlax_tpu.data.tokenizer import TokenizerError
    from rlax_tpu.models.hf import CheckpointError

    try:
        source = locate(args.source, step=args.step)
        config = run_config(source.run_dir)
        lora = config.model.lora
        if args.merged and lora is None:
            raise ExportError(
                f"--merged folds LoRA adapters into their base, but the run {source.run_dir} "
                "has none (model.lora is unset): its export is a plain model; drop --merged"
            )
        tokenizer_dir = args.tokenizer or run_tokenizer_dir(config, source.run_dir)
        out = _normalise(args.out)
        if storage.exists(storage.join(out, DIGEST_FILE)):
            raise ExportError(f"{out} is a run directory; give a new directory for the model")
        if not storage.exists(storage.join(tokenizer_dir, "tokenizer.json")):
            raise ExportError(
                f"the run's tokenizer directory {tokenizer_dir} has no tokenizer.json; name "
                "the tokenizer to ship with --tokenizer DIR"
            )
        params, description = restore_params(config, source)
        from rlax_tpu.models.export import BASE_DIR, export_hf, export_merged, export_peft

        if lora is None or args.merged:
            export = export_merged if args.merged else export_hf
            written = export(params, config.model, out, tokenizer_dir=tokenizer_dir)
            report = f"  to {out}: {_listing(written, out)}"
        else:
            base_dir = storage.join(out, BASE_DIR)
            written = export_peft(
                params, config.model, out, tokenizer_dir=tokenizer_dir, base_dir=base_dir
            )
            adapter = [u for u in written if not u.startswith(base_dir + "/")]
            report = (
                f"  as a PEFT adapter (LoRA rank {lora.rank}) to {out}: "
                f"{_listing(adapter, out)}\n"
                f"  with the base model it applies to in {base_dir}: "
                f"{_listing([u for u in written if u not in adapter], base_dir)}"
            )
    except NoValidCheckpointError as e:
        print(f"rlax-tpu export: nothing to export: {e}", file=sys.stderr)
        return 2
    except (ExportError, ConfigError, CheckpointError, TokenizerError, OSError) as e:
        print(f"rlax-tpu export: {e}", file=sys.stderr)
        return 2
    print(f"exported {description}\n{report}", flush=True)
    return 0


def _listing(written: list[str], directory: str) -> str:
    """The names of the files `written` in `directory`, sorted, comma-separated."""
    return ", ".join(sorted(u.removeprefix(directory + "/") for u in written))


# -- what to export --------------------------------------------------------------------------
def locate(path: str, *, step: int | None = None) -> ExportSource:
    """The run directory holding `path` (itself, or up to two levels up: the directory with
    the run's config.json) and the checkpoint `path` names in it."""
    path = _normalise(path)
    if not storage.exists(path):
        raise ExportError(f"{path} does not exist")
    run_dir, parts = path, []
    while not storage.exists(storage.join(run_dir, CONFIG_FILE)):
        parent, name = _parent(run_dir)
        if parent is None or len(parts) == 2:
            raise ExportError(
                f"{path} is neither a run directory nor a checkpoint in one: no {CONFIG_FILE} "
                "there or in the two directories above it"
            )
        parts.insert(0, name)
        run_dir = parent
    if not parts:
        return ExportSource(run_dir, None, step)
    kind = _KINDS.get(parts[0])
    if kind is None or (len(parts) == 2 and not parts[1].isdigit()):
        raise ExportError(
            f"{path} is in the run directory {run_dir} but is not a checkpoint; give the run "
            f"directory or one of its {CHECKPOINTS}/STEP directories"
        )
    named = int(parts[1]) if len(parts) == 2 else None
    if named is not None and step is not None and named != step:
        raise ExportError(f"{path} is the checkpoint of step {named}, but --step says {step}")
    return ExportSource(run_dir, kind, named if named is not None else step)


def run_config(run_dir: str) -> RunConfig:
    """The config the run's trainer ran: effective_config.json, else config.json; its
    storage.run_dir is `run_dir` (where the run is now, which may not be where it ran)."""
    from rlax_tpu.run_dir import EFFECTIVE_CONFIG

    for name in (EFFECTIVE_CONFIG, CONFIG_FILE):
        url = storage.join(run_dir, name)
        if not storage.exists(url):
            continue
        try:
            config = RunConfig.from_dict(json.loads(storage.read_text(url)))
        except (json.JSONDecodeError, ConfigError) as e:
            raise ExportError(
                f"{url} is not a run's config ({e}); is {run_dir} a run directory?"
            ) from None
        return dataclasses.replace(
            config, storage=dataclasses.replace(config.storage, run_dir=run_dir)
        )
    raise ExportError(f"{run_dir} has no {CONFIG_FILE}: it is not a run directory")


def run_tokenizer_dir(config: RunConfig, run_dir: str) -> str:
    """The tokenizer directory of the run: the model's tokenizer (as materialised into the run
    directory, where it was moved with it), else its hf_checkpoint."""
    from rlax_tpu.launch.job import (
        BUILTIN_CHAR_TOKENIZER,
        BUILTIN_CHAR_TOOLS_TOKENIZER,
        tokenizer_path,
    )

    local_copy = storage.join(run_dir, TOKENIZER)
    if config.model.tokenizer in (BUILTIN_CHAR_TOKENIZER, BUILTIN_CHAR_TOOLS_TOKENIZER):
        return local_copy
    try:
        path = tokenizer_path(config)
    except ValueError as e:
        raise ExportError(f"{e}; or name the tokenizer directory with --tokenizer DIR") from None
    if not storage.exists(storage.join(path, "tokenizer.json")) and storage.exists(
        storage.join(local_copy, "tokenizer.json")
    ):
        return local_copy  # a materialised tokenizer, recorded where the run first was
    return path


# -- restoring ---------------------------------------------------------------------------------
def restore_params(config: RunConfig, source: ExportSource) -> tuple[Any, str]:
    """(params, description) of the checkpoint `source` names, restored onto one CPU device:
    a pure dict of jax arrays in `config.model.param_dtype`, per layer or scan-stacked as
    the trainer held them. Raises NoValidCheckpointError when none loads, naming why."""
    _use_cpu()
    import jax

    from rlax_tpu.checkpoints import NoValidCheckpointError
    from rlax_tpu.config import MeshConfig
    from rlax_tpu.sharding import build_mesh
    from rlax_tpu.trainer.programs import TrainerPrograms

    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices("cpu")[:1])
    programs = TrainerPrograms(config, mesh)
    run_dir = source.run_dir
    rl_dir = storage.join(run_dir, CHECKPOINTS)
    warm_dir = storage.join(run_dir, WARM_START_CHECKPOINTS)

    if source.kind == "warm_start":
        return _restore(config, programs, "warm_start", warm_dir, source.step)
    if source.kind == "rl" or source.step is not None or _has_steps(rl_dir):
        try:
            return _restore(config, programs, "rl", rl_dir, source.step)
        except NoValidCheckpointError as e:
            if source.kind == "rl" or source.step is not None or not _has_steps(warm_dir):
                raise
            print(f"rlax-tpu export: {e}; exporting the SFT warm start instead", file=sys.stderr)
    if _has_steps(warm_dir):
        return _restore(config, programs, "warm_start", warm_dir, None)
    raise ExportError(
        f"nothing to export: the run directory {run_dir} holds no checkpoint (neither "
        f"{CHECKPOINTS}/ nor {WARM_START_CHECKPOINTS}/ has a step directory); the trainer "
        "writes one every trainer.checkpoint_every steps and when the SFT warm start ends"
    )


def _restore(
    config: RunConfig, programs: Any, kind: Kind, directory: str, step: int | None
) -> tuple[Any, str]:
    from rlax_tpu.checkpoints import CheckpointStore

    if not storage.exists(directory):
        raise ExportError(f"nothing to export: {directory} does not exist")
    # The trainer's checkpoint layouts (Trainer._abstract_state and _restore_warm_start).
    if kind == "rl":
        abstract = {"params": programs.abstract_params, "opt_state": programs.rl.abstract}
        if programs.objective.needs_reference_logprobs:
            # what training changes: the whole params, or a LoRA run's adapters alone
            abstract["reference"] = programs.abstract_trainable
    else:
        abstract = {"params": programs.abstract_params, "opt_state": programs.sft.abstract}
    store = CheckpointStore(
        directory, max_to_keep=config.trainer.max_checkpoints_to_keep, async_saves=False
    )
    try:
        restored = store.restore(abstract, step)
    finally:
        store.close()
    if kind == "rl":
        description = f"RL checkpoint of step {restored.step} (version {restored.step})"
    else:
        total = config.trainer.warm_start.steps
        unfinished = (
            f", unfinished: {restored.step} of {total} steps" if restored.step < total else ""
        )
        description = f"SFT warm-start checkpoint at step {restored.step}{unfinished}"
    return restored.state["params"], f"{description} of {directory}"


def _has_steps(directory: str) -> bool:
    """Whether `directory` has a step directory (finished or not: restoring decides)."""
    try:
        return any(name.isdigit() for name in storage.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return False


def _use_cpu() -> None:
    """Keep JAX to the CPU when it has not started yet: an export needs no accelerator, and
    one held by a running trainer or worker cannot be opened."""
    import jax
    from jax._src import xla_bridge

    if not getattr(xla_bridge, "_backends", {}):
        jax.config.update("jax_platforms", "cpu")


# -- paths -------------------------------------------------------------------------------------
def _normalise(path: str) -> str:
    if "://" in path:
        return path.rstrip("/") or path
    return os.path.abspath(path)


def _parent(url: str) -> tuple[str | None, str]:
    """(the parent directory of `url`, or None at a root or bucket; its last name)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    head, slash, name = rest.rstrip("/").rpartition("/")
    if not slash or not name or (sep and not head):
        return None, name
    if sep:
        return f"{scheme}://{head}", name
    return head or "/", name
