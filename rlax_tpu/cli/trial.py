"""`rlax-tpu run RECIPE --trial`: the recipe, sized for a CPU.

A trial keeps what makes the recipe the recipe (the model's architecture and checkpoint, the
data, the algorithm, the staleness paradigm, the verifier) and shrinks what a CPU host
cannot hold or finish in minutes: the accelerator settings (meshes, topology, GPU memory
shares), the KV pool and decode slots, the batch, the lengths, the steps and the SFT warm
start, the evaluation. It runs in its own directory (`<run_dir>_trial`), so it never mixes
with the real run's snapshots. Every change is returned as a line for the console; a field
the user set with `--set` is left as the user set it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from rlax_tpu.config import MeshConfig, RunConfig
from rlax_tpu.config.checkpoint import resolve_checkpoint_model
from rlax_tpu.config.run import RENAMED_FIELDS
from rlax_tpu.simulator.model import count_params

# The trial's sizes: two prompts of two samples a step (a group of two is the least a
# group-relative advantage needs), three steps, short answers.
PROMPTS = 2
SAMPLES = 2
STEPS = 3
MAX_NEW_TOKENS = 16
SFT_STEPS = 5
EVAL_SIZE = 8
PREFILL_BATCH = 2
# Bytes a parameter takes in the trainer: float32 weights, gradients and Adam's two moments.
TRAINER_BYTES_PER_PARAM = 16
# A CPU decodes far slower than an accelerator: a decode step may take this long before a
# worker is given up (controller.decode_step_deadline_s).
DECODE_STEP_DEADLINE_S = 10.0


def trial(config: RunConfig, user_set: Collection[str] = ()) -> tuple[RunConfig, list[str]]:
    """`config` (as loaded, its checkpoint's architecture not yet filled in: the recipe's
    lengths may be more than a small checkpoint's context) sized for a CPU trial and
    resolved, and one line per field changed ("key: old -> new"). Fields in `user_set` (the
    keys of the command line's --set) keep their value."""
    c = config
    rows = PROMPTS * SAMPLES
    new_tokens = c.inference.max_new_tokens
    if not _set_by_user("inference.max_new_tokens", user_set):
        new_tokens = min(new_tokens, MAX_NEW_TOKENS)
    sizes: dict[str, Any] = {
        # The accelerator: one process of each component, on this host's devices.
        "libtpu_flags": "",
        "trainer.mesh": _mesh(c.trainer.mesh, MeshConfig(data=1, fsdp=-1, tensor=1)),
        "inference.mesh": _mesh(c.inference.mesh, MeshConfig(data=1, fsdp=1, tensor=-1)),
        "trainer.gpu": "",
        "inference.gpu": "",
        "trainer.compiled_dir": "",
        "inference.num_workers": 1,
        "param_server.num_replicas": 1,
        "verifiers.num_workers": min(c.verifiers.num_workers, 2),
        # The batch and the lengths.
        "controller.prompts_per_batch": min(c.controller.prompts_per_batch, PROMPTS),
        "controller.samples_per_prompt": min(c.controller.samples_per_prompt, SAMPLES),
        "trainer.mini_batch_size": rows,
        "trainer.micro_batch_size": rows,
        "inference.max_new_tokens": new_tokens,
        # Exactly a prompt and a response (the trainer trains nothing cut).
        "trainer.max_seq_len": c.inference.max_prompt_len + new_tokens,
        "inference.max_decode_slots": min(c.inference.max_decode_slots, rows),
        "inference.prefill_batch_size": min(c.inference.prefill_batch_size, PREFILL_BATCH),
        "inference.decode_buckets": [],
        # The run's length.
        "controller.num_steps": min(c.controller.num_steps, STEPS),
        "trainer.warm_start.steps": min(c.trainer.warm_start.steps, SFT_STEPS),
        "controller.eval_size": min(c.controller.eval_size, EVAL_SIZE),
        "controller.eval_every": 0,
        "controller.decode_step_deadline_s": max(
            c.controller.decode_step_deadline_s, DECODE_STEP_DEADLINE_S
        ),
        "storage.run_dir": _trial_dir(c.storage.run_dir, c.name),
    }
    changes: list[str] = []
    c = resolve_checkpoint_model(_apply(c, sizes, user_set, changes))
    # A pool that holds every slot's longest sequence, plus the padding page: it needs the
    # architecture (KV bytes a token).
    i = c.inference
    worst_pages = -(-(i.max_prompt_len + i.max_new_tokens) // i.page_size)
    page_bytes = int(c.model.kv_bytes_per_token()) * i.page_size
    pool = {"inference.kv_cache_bytes": page_bytes * (1 + i.max_decode_slots * worst_pages)}
    return _apply(c, pool, user_set, changes), changes


def _apply(
    config: RunConfig, plan: dict[str, Any], user_set: Collection[str], changes: list[str]
) -> RunConfig:
    """`config` with `plan`'s values (but not the keys in `user_set`), validated once as a
    whole; a line for each value changed appended to `changes`."""
    data = config.to_dict()
    for key, value in plan.items():
        if _set_by_user(key, user_set):
            continue
        old = _get(data, key)
        new = value.to_dict() if isinstance(value, MeshConfig) else value
        if old != new:
            _put(data, key, new)
            changes.append(f"{key}: {_show(key, old)} -> {_show(key, new)}")
    return RunConfig.from_dict(data)


def memory_note(config: RunConfig, host_bytes: int | None = None) -> str:
    """A line when the model alone is more than this host holds ("" when it fits): a trial
    keeps the architecture, so it cannot shrink the model."""
    if host_bytes is None:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    params = count_params(config.model)
    need = params * TRAINER_BYTES_PER_PARAM
    if need <= 0.8 * host_bytes:
        return ""
    return (
        f"note: the model has {params / 1e9:.1f}B parameters; its trainer alone holds about "
        f"{need / 2**30:,.0f} GiB (float32 weights, gradients, Adam), over this host's "
        f"{host_bytes / 2**30:,.0f} GiB: the trial will run out of memory. `--set "
        "model.num_layers=2` keeps every layer's shape and runs on fewer of them"
    )


def _mesh(current: MeshConfig, cpu: MeshConfig) -> MeshConfig:
    """One slice, no topology, the CPU's devices on the usual axis; the recipe's sharding
    rules kept."""
    return MeshConfig(
        data=cpu.data,
        fsdp=cpu.fsdp,
        tensor=cpu.tensor,
        logical_axis_rules=current.logical_axis_rules,
    )


def _trial_dir(run_dir: str, name: str) -> str:
    """The trial's own directory beside the run's (local: a gs:// run's trial stays here)."""
    if "://" in run_dir and not run_dir.startswith("file://"):
        return f"runs/{name}_trial"
    return run_dir.rstrip("/") + "_trial"


def _set_by_user(key: str, user_set: Collection[str]) -> bool:
    # A field the user set by its old path (RENAMED_FIELDS) is set all the same.
    user_set = [RENAMED_FIELDS.get(k, k) for k in user_set]
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in user_set)


def _get(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *head, last = key.split(".")
    for part in head:
        data = data[part]
    data[last] = value


def _show(key: str, value: Any) -> str:
    if isinstance(value, dict):  # a mesh: its axes (and topology)
        axes = ",".join(f"{k}={value[k]}" for k in ("data", "fsdp", "tensor"))
        return axes + (f" on {value['topology']}" if value["topology"] else "")
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{value / 2**20:,.0f} MiB" if value >= 2**20 else f"{value / 2**10:,.0f} KiB"
    return repr(value) if isinstance(value, str) else str(value)
