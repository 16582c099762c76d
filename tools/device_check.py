#!/usr/bin/env python3
"""One-command accelerator check of a GPU or TPU host: the engine's decode rate against the
chip's HBM roofline, the trainer's MFU, the attention kernels' numerics, the GSM8K recipe's
first RL steps and the weight sync, written to one JSON report.

    python3 tools/device_check.py [--platform gpu|tpu|cpu] [--parts kernels,decode,...]
        [--budget-s 600] [--json OUT] [--set KEY=VALUE ...] [--dry-run] [--tiny]
    rlax-tpu bench device [the same options]

It needs nothing but the checkout. The platform comes from `nvidia-smi` (a GPU), the TPU VM's
environment (TPU_ACCELERATOR_TYPE, /dev/accel*, /dev/vfio/N) or --platform; the chip's peak
figures from rlax_tpu/hardware.py (CHIPS, GPUS), named by what JAX reports or
--chip. Unless JAX already runs on the platform, it first installs the package with the
platform's extra of pyproject.toml (`pip install -e ".[cuda]"`, `".[tpu]"`).

Every part measures the GSM8K recipes' model (Qwen2.5-0.5B-Instruct's architecture, from
configs/models/Qwen2.5-0.5B-Instruct/config.json, random weights; bf16 compute) and runs in
a process of its own, one after the other: a part that fails (an exception, a crash, its
share of the time budget spent) is recorded in the report with its error and the log's last
lines, and the next part runs. The parts:

* `kernels`: the attention kernels the platform runs against the pure-JAX float32 reference
  on the same bf16 inputs (training attention forward and gradients: splash on TPU, cuDNN
  through jax.nn.dot_product_attention on GPU; paged decode: the Pallas kernel of the
  platform and the JAX flash-decode path); max abs error against a stated tolerance.
* `decode`: the inference engine's decode tokens/s at several batch sizes, on one chip,
  timed as the difference of two runs that differ only in their number of new tokens (so
  prefill and compiles cancel out), tools/bench_inference.py's interleaved best-of timing;
  the HBM bytes a step must read (weights + live KV) per second against the chip's bandwidth.
* `trainer`: tools/bench_trainer.py's GRPO step on the model; MFU = model FLOPs
  (rlax_tpu.simulator.model.train_flops_per_token) per second / the chips' peak bf16 FLOP/s.
* `weight_sync`: publish of the bf16 weights to a parameter-server process
  (tools/bench_param_server.py's) and a rollout worker's load of them (pull + swap).
* `gsm8k`: `rlax-tpu run` of the platform's GSM8K recipe for 3 steps on a random-weights
  checkpoint written by rlax_tpu.models.hf.save_hf and generated GSM8K-shaped rows, with its
  step times. Not on a TPU host: the TPU recipe puts the trainer and the worker on two
  slices, and the local launcher cannot split one host's chips between two processes.

--dry-run measures nothing and needs no accelerator: it checks the platform detection, the
install command, every part's configuration (configs load and validate with --set, the
shapes fit the chip of the platform: its memory, by an estimate stated in each part) and
the report's schema, and prints the plan. --tiny shrinks every part to a CPU's size (with
--platform cpu: a smoke run of the code paths). The report's `markdown_row` is a row of the
"Measured on" table in docs/gpu_tpu_recipes.md.

The script starts with the standard library only, since on a fresh machine it installs the
package before anything else; the project's modules are imported once that is done, in the
functions that use them (the parts' JAX code only in their own processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
for _path in (str(ROOT), str(TOOLS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

SCHEMA = "rlax_tpu.device_check/1"
PLATFORMS = ("gpu", "tpu", "cpu")
# pyproject.toml's extra for each platform (None: the package alone).
EXTRAS = {"gpu": "cuda", "tpu": "tpu", "cpu": None}
# What the part processes set JAX_PLATFORMS to: a GPU that JAX cannot use is an error in the
# part, not a silent run on the CPU.
JAX_PLATFORMS = {"gpu": "cuda", "tpu": "tpu", "cpu": "cpu"}
RECIPES = {
    "gpu": "configs/qwen2_5_0_5b_gsm8k_gpu.py",
    "tpu": "configs/qwen2_5_0_5b_gsm8k_tpu.py",
    "cpu": "configs/qwen2_5_0_5b_gsm8k_gpu.py",
}
# Without a chip to read (a dry run elsewhere): the recipes' own hardware, one H100 and a
# v5e 2x2 slice.
DEFAULT_CHIPS = {"gpu": "h100", "tpu": "v5e"}
DEFAULT_DEVICES = {"gpu": 1, "tpu": 4, "cpu": 1}
# A part's process may use this much of each chip: JAX preallocates 75% of a GPU by default;
# on a TPU, hardware.FIT_FRACTION of its HBM.
GPU_MEMORY_FRACTION = 0.75
STATUSES = ("planned", "ok", "failed", "skipped")
PART_ORDER = ("kernels", "decode", "trainer", "weight_sync", "gsm8k")
# Each part's most of the budget (seconds); it also gets no more than what is left.
PART_CAPS_S = {"kernels": 90, "decode": 150, "trainer": 150, "weight_sync": 90, "gsm8k": 300}
MIN_PART_S = 20  # a part gets at least this much of the budget, or is skipped
# A kernel passes when |kernel - reference| <= ATOL + RTOL·|reference| elementwise (its
# gradients: <= RTOL·max|reference gradient|): bf16 inputs and outputs keep 8 bits of
# mantissa, the bound of tests/test_attention_backends.py.
KERNEL_ATOL = KERNEL_RTOL = 2e-2
STEPS = 3  # the GSM8K recipe's RL steps

# The tiny model of --tiny: a Qwen2 (q/k/v biases, tied embeddings) a CPU runs in seconds,
# as the config.json a checkpoint of it has.
TINY_HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

MARKDOWN_HEADER = (
    "| date | device | software | decode tokens/s by batch (of HBM roofline) | trainer MFU "
    "| kernels: max abs error | GSM8K: s per step (of 3) | weight sync: publish + load |"
)


class PlanError(ValueError):
    """The check cannot run as asked (an unknown platform, chip or part, a config that does
    not validate, shapes that do not fit the chip); the message names the fix."""


class ReportSchemaError(ValueError):
    """A report does not have the shape of SCHEMA; the message names the key."""


# -- platform, chip, install ---------------------------------------------------------------------
def list_gpus() -> list[tuple[str, int]]:
    """(name, memory MiB) of each GPU nvidia-smi lists; [] without nvidia-smi or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.splitlines():
        name, _, memory = line.rpartition(",")
        if name.strip():
            gpus.append((name.strip(), int(memory) if memory.strip().isdigit() else 0))
    return gpus


def tpu_device_files() -> list[str]:
    """The TPU chips' device files of a TPU VM: /dev/accelN (v4, v5e) or /dev/vfio/N (v5p,
    v6e)."""
    found = []
    for folder, pattern in (("/dev", r"accel\d+"), ("/dev/vfio", r"\d+")):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found += [f"{folder}/{n}" for n in sorted(names) if re.fullmatch(pattern, n)]
    return found


def detect_platform(
    environ: Mapping[str, str] | None = None,
    *,
    gpus: Sequence[tuple[str, int]] | None = None,
    tpu_files: Sequence[str] | None = None,
) -> tuple[str, str]:
    """("gpu" | "tpu" | "cpu", the evidence): a GPU when nvidia-smi lists one, a TPU when
    the environment names a TPU accelerator type or the host has TPU device files, else the
    CPU. `gpus` and `tpu_files` default to what this host has."""
    environ = os.environ if environ is None else environ
    gpus = list_gpus() if gpus is None else gpus
    if gpus:
        names = ", ".join(sorted({name for name, _ in gpus}))
        return "gpu", f"nvidia-smi lists {len(gpus)} GPU(s): {names}"
    accelerator = environ.get("TPU_ACCELERATOR_TYPE", "")
    if accelerator:
        return "tpu", f"TPU_ACCELERATOR_TYPE={accelerator}"
    files = tpu_device_files() if tpu_files is None else tpu_files
    if files:
        return "tpu", f"TPU device files: {', '.join(files[:4])}"
    return "cpu", "no GPU in nvidia-smi, no TPU_ACCELERATOR_TYPE, no TPU device files"


def chip_from_name(platform: str, name: str) -> str | None:
    """The hardware-table key of a GPU or TPU named as nvidia-smi, JAX's device_kind or a
    TPU accelerator type name it ("NVIDIA H100 80GB HBM3", "TPU v5 lite", "v5litepod-4");
    None when the table has no entry for it."""
    text = name.lower()
    if platform == "gpu":
        if "a100" in text:
            return "a100-40gb" if "40gb" in text else "a100-80gb"
        for key in ("h200", "h100", "l4"):
            if re.search(rf"\b{key}\b", text):
                return key
        return None
    if platform == "tpu":
        for pattern, key in (
            (r"v6e|v6 lite", "v6e"),
            (r"v5litepod|v5e|v5 lite", "v5e"),
            (r"v5p|tpu v5$", "v5p"),
            (r"\bv4\b|v4-", "v4"),
        ):
            if re.search(pattern, text):
                return key
    return None


def chip_table(platform: str) -> dict:
    from rlax_tpu.hardware import CHIPS, GPUS

    return {"gpu": GPUS, "tpu": CHIPS}.get(platform, {})


def pyproject_extra(extra: str) -> list[str]:
    """The requirements of pyproject.toml's optional dependency group `extra`."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = data.get("project", {}).get("optional-dependencies", {})
    if extra not in groups:
        raise PlanError(
            f"pyproject.toml defines no extra {extra!r} (it has {', '.join(sorted(groups))}): "
            "the install command would fail"
        )
    return list(groups[extra])


def install_plan(platform: str) -> dict:
    """The install command for `platform` and the requirements its extra brings."""
    extra = EXTRAS[platform]
    target = str(ROOT) + (f"[{extra}]" if extra else "")
    return {
        "command": [sys.executable, "-m", "pip", "install", "-e", target],
        "extra": extra,
        "requirements": pyproject_extra(extra) if extra else [],
        "status": "planned",
        "seconds": None,
        "detail": "",
    }


# What a process on the platform sees: JAX's version, backend and devices. It imports the
# package's JAX-side modules too, so a missing dependency shows here.
PROBE = (
    "import json, jax; import rlax_tpu.trainer, rlax_tpu.inference; d = jax.devices(); "
    "print(json.dumps({'jax': jax.__version__, 'backend': jax.default_backend(), "
    "'device_kind': d[0].device_kind, 'devices': len(d)}))"
)


def probe(platform: str) -> tuple[dict | None, str]:
    """(what JAX sees on `platform`, "") or (None, why not)."""
    env = dict(os.environ, JAX_PLATFORMS=JAX_PLATFORMS[platform])
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # it only looks
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return None, "the probe (import jax, list the devices) took over 300 s"
    if out.returncode != 0:
        return None, last_lines(out.stderr or out.stdout, 6)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {"gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}[platform]
    if seen["backend"] != expected:
        return None, f"JAX runs on {seen['backend']!r}, not {expected!r}"
    return seen, ""


def ensure_installed(platform: str, install: dict, mode: str) -> dict:
    """Install the package with the platform's extra unless (mode "auto") JAX already runs on
    the platform; what JAX then sees. Raises PlanError when it still does not."""
    seen, why = (None, "--install always") if mode == "always" else probe(platform)
    if seen is not None:
        install.update(status="skipped", detail=f"JAX {seen['jax']} already runs on the {platform}")
        return seen
    if mode == "never":
        install.update(status="skipped", detail="--install never")
        raise PlanError(f"JAX does not run on the {platform} ({why}) and --install never was given")
    print(f"installing ({why}): {shlex.join(install['command'])}", flush=True)
    start = time.monotonic()
    done = subprocess.run(install["command"], cwd=ROOT)
    install["seconds"] = round(time.monotonic() - start, 1)
    if done.returncode != 0:
        install.update(status="failed", detail=f"pip exited with code {done.returncode}")
        raise PlanError(f"the install failed (pip exited with code {done.returncode})")
    install["status"] = "ran"
    seen, why = probe(platform)
    if seen is None:
        raise PlanError(
            f"after the install JAX still does not run on the {platform}: {why}. On a GPU host "
            "check the driver (nvidia-smi; CUDA 12 needs driver 525 or later)"
        )
    install["detail"] = f"JAX {seen['jax']} runs on the {platform}"
    return seen


# -- the target and the options ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """What the check runs on: the platform, the hardware-table chip (None: no entry, so no
    roofline), how many of them, and whether the parts are shrunk to a CPU's size."""

    platform: str
    evidence: str
    chip: str | None
    chip_source: str
    devices: int
    tiny: bool
    device_kind: str = ""
    jax: str = ""

    def spec(self) -> dict | None:
        return None if self.chip is None else chip_table(self.platform)[self.chip].to_json()

    def memory_per_device(self) -> float | None:
        """Bytes a part's process may use on each chip (None on the CPU: not checked)."""
        from rlax_tpu.hardware import FIT_FRACTION

        spec = self.spec()
        if spec is None:
            return None
        share = GPU_MEMORY_FRACTION if self.platform == "gpu" else FIT_FRACTION
        return share * spec["hbm_bytes"]

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "spec": self.spec()}


@dataclasses.dataclass(frozen=True)
class Options:
    batch_sizes: tuple[int, ...] | None
    sets: tuple[str, ...]
    trainer_micro_batch: int | None
    decode_steps: int


def resolve_target(platform: str, evidence: str, args: argparse.Namespace, seen: dict | None):
    """The Target of this run: the chip from --chip, else from what JAX reports (a real run),
    nvidia-smi or the TPU environment, else the recipes' own (a dry run elsewhere)."""
    if platform == "cpu" and not args.tiny:
        raise PlanError(
            "--platform cpu needs --tiny: the 0.5B model on a CPU takes far longer than the "
            "budget (--tiny runs every part at a CPU's size, a smoke run of the code paths)"
        )
    table = chip_table(platform)
    kind = (seen or {}).get("device_kind", "")
    if args.chip:
        if args.chip not in table:
            names = ", ".join(table) or "none: the CPU has no chip table"
            raise PlanError(f"unknown {platform} chip {args.chip!r}; known: {names}")
        chip, source = args.chip, "--chip"
    elif platform == "cpu":
        chip, source = None, "the CPU has no entry in the chip table: no roofline"
    else:
        names = [kind] if kind else []
        if platform == "gpu" and not names:
            names = [name for name, _ in list_gpus()[:1]]
        if platform == "tpu":
            names.append(os.environ.get("TPU_ACCELERATOR_TYPE", ""))
        matches = [(chip_from_name(platform, n), n) for n in names if n]
        found = next(((c, n) for c, n in matches if c), None)
        if found:
            chip, source = found[0], f"from {found[1]!r}"
        elif seen is None:  # a dry run on another host: the recipe's hardware
            chip, source = DEFAULT_CHIPS[platform], "the GSM8K recipe's hardware (--chip to change)"
        else:
            chip, source = None, f"{kind!r} has no entry in the chip table: no roofline (--chip)"
    if seen is not None:
        devices = int(seen["devices"])
    else:
        devices = args.devices or DEFAULT_DEVICES[platform]
    return Target(
        platform=platform,
        evidence=evidence,
        chip=chip,
        chip_source=source,
        devices=devices,
        tiny=args.tiny,
        device_kind=kind,
        jax=(seen or {}).get("jax", ""),
    )


# -- the plans: each part's configuration, validated without JAX -----------------------------------
def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def recipe_config(target: Target, sets: Sequence[str] = ()):
    """The platform's GSM8K recipe with `sets` applied (validated: ConfigError as PlanError)."""
    from rlax_tpu.config import ConfigError, load_config

    try:
        return load_config(str(ROOT / RECIPES[target.platform]), list(sets))
    except ConfigError as e:
        raise PlanError(f"{RECIPES[target.platform]}: {e}") from None


def part_model(target: Target):
    """The model every part measures: the GSM8K recipe's (Qwen2.5-0.5B-Instruct from its
    config.json; float32 master weights, bf16 compute and published weights), or the tiny
    Qwen2 of TINY_HF_CONFIG with the same dtypes. Random weights: no checkpoint."""
    from rlax_tpu.config.checkpoint import config_from_hf_dict

    model = recipe_config(target).model
    if target.tiny:
        tiny = config_from_hf_dict(TINY_HF_CONFIG, source="TINY_HF_CONFIG")
        model = dataclasses.replace(
            tiny,
            param_dtype=model.param_dtype,
            dtype=model.dtype,
            publish_dtype=model.publish_dtype,
        )
    return dataclasses.replace(model, hf_checkpoint="")


def memory_check(part: str, target: Target, need: float, what: str, fix: str) -> dict:
    """A part's estimate of the bytes it needs on each chip against what it may use there;
    PlanError naming the fix when it is over."""
    room = target.memory_per_device()
    fits = room is None or need <= room
    if not fits:
        raise PlanError(
            f"{part}: needs about {gib(need)} per chip ({what}), over the {gib(room)} a process "
            f"may use on a {target.chip}; {fix}"
        )
    return {"estimate_bytes": int(need), "available_bytes": room and int(room), "what": what}


def memory_text(memory: Mapping[str, Any]) -> str:
    room = memory["available_bytes"]
    return f"memory ~{gib(memory['estimate_bytes'])} per chip" + (
        f" of the {gib(room)} a process may use ({memory['what']})" if room else ""
    )


def plan_kernels(target: Target, options: Options) -> dict:
    """The kernels the platform runs against the reference: cases of (function, shape)."""
    model = part_model(target)
    qwen = {"q_heads": model.num_heads, "kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
    if target.tiny:
        train = {"batch": 1, "seq": 128, "q_heads": 4, "kv_heads": 2, "head_dim": 64}
        decode = {"slots": 3, "page_size": 16, "pages_per_seq": 4, "lengths": [1, 17, 64]}
    else:
        train = {"batch": 2, "seq": 1024, **qwen}
        decode = {"slots": 8, "page_size": 16, "pages_per_seq": 64}
        decode["lengths"] = [1, 15, 16, 17, 300, 511, 777, 1024]
    # The JAX path and the GPU kernel at the model's heads; the TPU kernel needs head_dim a
    # multiple of 128, so Qwen2.5-0.5B's 64 runs the JAX path there ("auto") and the kernel
    # is checked at Llama-3-8B's heads.
    if target.tiny:
        jax_decode = {**decode, "q_heads": 4, "kv_heads": 2, "head_dim": 16}
        tpu_decode = {**decode, "q_heads": 2, "kv_heads": 1, "head_dim": 128}
    else:
        jax_decode = {**decode, **qwen}
        tpu_decode = {**decode, "q_heads": 32, "kv_heads": 8, "head_dim": 128}
    cases = {
        "gpu": [
            ("train_attention", "dot_product", train),
            ("train_attention", "cudnn", train),
            ("decode_attention", "pallas_gpu", jax_decode),
            ("decode_attention", "jax", jax_decode),
        ],
        "tpu": [
            ("train_attention", "splash", train),
            ("decode_attention", "pallas_tpu", tpu_decode),
            ("decode_attention", "jax", jax_decode),
        ],
        # The CPU runs the Pallas kernels interpreted: their numerics, not their speed.
        "cpu": [
            ("train_attention", "splash", train),
            ("train_attention", "dot_product", train),
            ("decode_attention", "pallas_tpu", tpu_decode),
            ("decode_attention", "pallas_gpu", jax_decode),
            ("decode_attention", "jax", jax_decode),
        ],
    }[target.platform]
    planned = []
    for kind, kernel, shape in cases:
        if shape["q_heads"] % shape["kv_heads"]:
            raise PlanError(f"kernels: {kernel}: q_heads must be a multiple of kv_heads: {shape}")
        if kind == "decode_attention" and max(shape["lengths"]) > (
            shape["pages_per_seq"] * shape["page_size"]
        ):
            raise PlanError(f"kernels: {kernel}: a length is over the page table's: {shape}")
        planned.append({"kind": kind, "kernel": kernel, "shape": shape})
    summary = [f"{c['kind']}: {c['kernel']} vs {shape_text(c['shape'])}" for c in planned]
    summary.append(
        f"pass: |kernel - reference| <= {KERNEL_ATOL} + {KERNEL_RTOL}·|reference| (gradients: "
        f"<= {KERNEL_RTOL}·max|reference gradient|)"
    )
    return {"cases": planned, "summary": summary, "memory": None}


def shape_text(shape: Mapping[str, Any]) -> str:
    """A kernel case's shape in a line: what the reference gets, what is compared."""
    heads = f"{shape['q_heads']}/{shape['kv_heads']} heads of {shape['head_dim']}"
    if "seq" in shape:
        return (
            f"the float32 reference, forward and gradients, bf16 [{shape['batch']}, "
            f"{shape['seq']}] tokens, {heads}"
        )
    return (
        f"every page gathered in float32, {shape['slots']} slots, {heads}, bf16 pages of "
        f"{shape['page_size']}, lengths {shape['lengths']}"
    )


def plan_decode(target: Target, options: Options) -> dict:
    """The engine on one chip at each batch size: a prompt, then `short` and `long` new
    tokens; the difference is decode alone."""
    from rlax_tpu.config import ConfigError, InferenceConfig, MeshConfig
    from rlax_tpu.simulator.model import count_params

    model = part_model(target).served()  # bf16 weights, as workers serve them
    sizes = tuple(sorted(set(options.batch_sizes or ((1, 4) if target.tiny else (1, 16, 64, 256)))))
    prompt, short, long = (16, 8, 24) if target.tiny else (128, 32, 160)
    if min(sizes) < 1:
        raise PlanError(f"decode: batch sizes must be >= 1, got {sizes}")
    if prompt + long > model.max_position_embeddings:
        raise PlanError(f"decode: {prompt + long} tokens exceed the model's context")
    page = 16
    per_token = model.kv_bytes_per_token()
    pages = -(-(prompt + long) // page)
    kv_bytes = int((max(sizes) * pages + 1) * page * per_token)  # every slot's worst case + pad
    try:
        inference = InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=1),
            max_decode_slots=max(sizes),
            decode_buckets=sizes,
            page_size=page,
            kv_cache_bytes=kv_bytes,
            prefill_buckets=(prompt,),
            prefill_batch_size=min(16, max(sizes)),
            max_prompt_len=prompt,
            max_new_tokens=long,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            prefetch_weights=False,
        )
    except ConfigError as e:
        raise PlanError(f"decode: {e}") from None
    weights = count_params(model) * 2
    # The JAX paged-attention path keeps two more copies of the pool (docs/gpu_tpu_recipes.md);
    # sampling over the vocabulary keeps a few float32 [batch, vocab] arrays.
    need = weights + 3 * kv_bytes + 4 * 4 * max(sizes) * model.vocab_size
    memory = memory_check(
        "decode",
        target,
        need,
        "bf16 weights + 3 x the KV pool + float32 [batch, vocab] temporaries",
        "give smaller --batch-sizes",
    )
    context = prompt + (short + long) / 2
    spec = target.spec()
    expected = {}
    for b in sizes:
        step_bytes = weights + b * context * per_token
        expected[b] = spec and round(b * spec["hbm_bytes_per_s"] / step_bytes, 1)
    summary = [
        f"engine decode on 1 chip, batch sizes {', '.join(map(str, sizes))}: prompts of {prompt} "
        f"tokens, {short} and {long} new tokens (decode = the difference), "
        f"{options.decode_steps} step(s) per call, attention_backend auto, KV pool {gib(kv_bytes)}",
        memory_text(memory),
    ]
    if spec:
        summary.append(
            "HBM roofline (weights + live KV at "
            f"{spec['hbm_bytes_per_s'] / 1e9:.0f} GB/s), tokens/s: "
            + ", ".join(f"{b}: {expected[b]:,.0f}" for b in sizes)
        )
    return {
        "model": model.to_dict(),
        "inference": inference.to_dict(),
        "batch_sizes": list(sizes),
        "prompt_len": prompt,
        "new_tokens": [short, long],
        "decode_steps_per_call": options.decode_steps,
        "repeats": 2 if target.tiny else 3,
        "roofline_tokens_per_s": {str(b): v for b, v in expected.items()},
        "memory": memory,
        "summary": summary,
    }


def train_memory(model, micro: int, seq: int, devices: int) -> float:
    """Bytes per chip of a train step without remat, estimated: params, gradients and a
    reference copy in the param dtype plus Adam's two float32 moments (sharded over every
    chip, fsdp), and activations (split by rows over the chips): per token and layer the
    bf16 inputs of the norms, q/k/v, attention output and the MLP's three projections, and
    three float32 [tokens, vocab] arrays at the head (logits, log-softmax, its gradient)."""
    from rlax_tpu.simulator.model import DTYPE_BYTES, count_params

    c = model
    state = count_params(c) * (3 * DTYPE_BYTES[c.param_dtype] + 8) / devices
    layer = 4 * c.hidden_size + c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    layer += 3 * c.intermediate_size
    per_token = c.num_layers * 2 * layer + 12 * c.vocab_size
    return state + micro * seq * per_token / min(devices, micro)


def plan_trainer(target: Target, options: Options) -> dict:
    """tools/bench_trainer.py's step (its settings: GRPO, fsdp over every chip, no remat,
    attention_backend auto) on the model, at a batch of `rows` x `seq` tokens."""
    from rlax_tpu.config import (
        AlgorithmConfig,
        ConfigError,
        ControllerConfig,
        MeshConfig,
        RunConfig,
        TrainerConfig,
    )
    from rlax_tpu.simulator.model import train_flops_per_token

    model = part_model(target)
    # --tiny: 192 tokens, the least RunConfig's default inference limits (128 + 64) allow.
    prompts, samples, mini, micro, seq = (2, 2, 4, 2, 192) if target.tiny else (8, 8, 64, 8, 1024)
    micro = options.trainer_micro_batch or micro
    try:
        RunConfig(
            model=model,
            controller=ControllerConfig(prompts_per_batch=prompts, samples_per_prompt=samples),
            trainer=TrainerConfig(
                mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
                algorithm=AlgorithmConfig(name="grpo"),
                mini_batch_size=mini,
                micro_batch_size=micro,
                max_seq_len=seq,
            ),
        )
    except ConfigError as e:
        raise PlanError(f"trainer: {e}") from None
    need = train_memory(model, micro, seq, target.devices)
    memory = memory_check(
        "trainer",
        target,
        need,
        "params, gradients, Adam, a reference copy; activations without remat",
        "give a smaller --trainer-micro-batch",
    )
    rows, steps = prompts * samples, 2 if target.tiny else STEPS
    flops = train_flops_per_token(model, seq) * rows * seq
    spec = target.spec()
    summary = [
        f"GRPO step (tools/bench_trainer.py) of {rows} x {seq} tokens, mini-batch {mini}, "
        f"micro-batch {micro}, fsdp over {target.devices} chip(s); {steps} timed steps after one "
        "that compiles",
        f"model FLOPs {flops / 1e12:.1f} TFLOP a step (update only: 6·params + attention per "
        f"token); {memory_text(memory)}",
    ]
    if spec:
        best = flops / (spec["peak_flops_per_s"] * target.devices)
        summary.append(f"at 100% MFU a step takes {best:.3f} s")
    return {
        "model": model.to_dict(),
        "shape": {"prompts": prompts, "samples": samples, "mini": mini, "micro": micro, "seq": seq},
        "steps": steps,
        "model_flops_per_step": flops,
        "memory": memory,
        "summary": summary,
    }


def plan_weight_sync(target: Target, options: Options) -> dict:
    """Publish of the bf16 weights to a parameter-server process and a worker's load."""
    from rlax_tpu.config import InferenceConfig, MeshConfig
    from rlax_tpu.simulator.model import count_arrays, model_bytes

    model = part_model(target)
    inference = InferenceConfig(
        mesh=MeshConfig(data=1, fsdp=1, tensor=1),
        max_decode_slots=8,
        kv_cache_bytes=int(64 * 16 * model.kv_bytes_per_token()),
        prefill_buckets=(16,),
        max_prompt_len=16,
        max_new_tokens=8,
        prefetch_weights=False,
    )
    published = model_bytes(model)
    memory = memory_check(
        "weight_sync",
        target,
        2 * published + inference.kv_cache_bytes,
        "the published copy and the worker's",
        "(the model alone does not fit this chip)",
    )
    versions = 4 if target.tiny else 3
    summary = [
        f"{versions} versions of {gib(published)} in {count_arrays(model)} arrays "
        f"({model.published_dtype}): publish from the device to a parameter-server process, "
        "then a rollout worker's load (pull + swap onto its device)",
        memory_text(memory),
    ]
    return {
        "model": model.to_dict(),
        "inference": inference.to_dict(),
        "versions": versions,
        "bytes": published,
        "memory": memory,
        "summary": summary,
    }


# Sizes a CPU runs in seconds (tests/test_gsm8k_recipe.py's), in an order every prefix of
# which validates.
TINY_RECIPE_SETS = (
    "inference.max_new_tokens=8",
    "inference.max_prompt_len=128",
    "trainer.max_seq_len=136",
    "inference.prefill_buckets=128,",
    "inference.prefill_batch_size=4",
    "inference.max_decode_slots=4",
    "inference.kv_cache_bytes=4194304",
    "trainer.micro_batch_size=4",
    "trainer.mini_batch_size=4",
    "controller.prompts_per_batch=2",
    "controller.samples_per_prompt=2",
    "trainer.logprob_chunk_size=0",
    "verifiers.num_workers=1",
    "controller.overlong_prompts=drop",
)
# The recipe as it is, but responses of 256 tokens (1024 in the recipe): random weights never
# stop early, and 3 steps of 1024 decode steps overrun a 10-minute check. --set
# inference.max_new_tokens=1024 --set trainer.max_seq_len=1536 gives the recipe's.
RECIPE_SETS = ("inference.max_new_tokens=256", "trainer.max_seq_len=768")
GSM8K_ROWS = 64


def gsm8k_sets(target: Target, options: Options, paths: Mapping[str, str]) -> list[str]:
    """The --set list of the recipe's run: `paths` has checkpoint, data and run_dir."""
    sets = [
        f"model.hf_checkpoint={paths['checkpoint']}",
        f"data.path={paths['data']}",
        f"storage.run_dir={paths['run_dir']}",
        f"controller.num_steps={STEPS}",
        "controller.eval_dataset=",  # no held-out evaluation: 3 steps of random weights
    ]
    sets += TINY_RECIPE_SETS if target.tiny else RECIPE_SETS
    return sets + list(options.sets)


def plan_gsm8k(target: Target, options: Options) -> dict:
    """The recipe's run, validated as `rlax-tpu run` will load it: with the run's --set list
    on a stand-in checkpoint of the same config.json and data of the same layout."""
    from rlax_tpu.config import ConfigError
    from rlax_tpu.launch.launcher import check_colocated_gpu_memory

    recipe = RECIPES[target.platform]
    with tempfile.TemporaryDirectory(prefix="rlax-device-check-plan-") as tmp:
        if target.tiny:
            checkpoint = Path(tmp) / "checkpoint"
            checkpoint.mkdir()
            (checkpoint / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
        else:  # the checkpoint the run writes has this config.json's architecture
            checkpoint = ROOT / "configs" / "models" / "Qwen2.5-0.5B-Instruct"
        data = Path(tmp) / "gsm8k_train.jsonl"
        write_gsm8k_rows(data, GSM8K_ROWS)
        paths = {"checkpoint": str(checkpoint), "data": str(data), "run_dir": f"{tmp}/run"}
        try:
            config = recipe_config(target, gsm8k_sets(target, options, paths))
        except PlanError as e:
            raise PlanError(f"gsm8k: the recipe with the check's sizes and --set: {e}") from None
    try:
        environ = {"JAX_PLATFORMS": JAX_PLATFORMS[target.platform]}
        check_colocated_gpu_memory(config, environ=environ)
    except ConfigError as e:
        raise PlanError(f"gsm8k: {e}") from None
    c = config
    skip = ""
    if target.platform == "tpu":
        skip = (
            "the TPU recipe runs the trainer and the inference worker on two slices (GKE: "
            "rlax-tpu deploy gke); the local launcher cannot split one host's chips between "
            "its two processes"
        )
    placeholders = {"checkpoint": "{checkpoint}", "data": "{data}", "run_dir": "{run_dir}"}
    summary = [
        f"rlax-tpu run {recipe} for {STEPS} steps: random-weights checkpoint (save_hf), "
        f"{GSM8K_ROWS} GSM8K-shaped rows; {c.controller.prompts_per_batch} prompts x "
        f"{c.controller.samples_per_prompt} samples, responses up to "
        f"{c.inference.max_new_tokens} tokens, micro-batch {c.trainer.micro_batch_size}, "
        f"reload_every {c.staleness.reload_every}, max_staleness {c.staleness.max_staleness}",
    ]
    if target.platform == "gpu":
        summary.append(
            f"memory: the recipe's shares of the GPU (trainer {c.trainer.gpu_memory_fraction:.0%}"
            f", worker {c.inference.gpu_memory_fraction:.0%}); `rlax-tpu compile "
            f"{recipe}` checks its programs against them"
        )
    if skip:
        summary.append(f"skipped on this platform: {skip}")
    return {
        "recipe": recipe,
        "sets": gsm8k_sets(target, options, placeholders),
        "steps": STEPS,
        "rows": GSM8K_ROWS,
        "checkpoint_model": dataclasses.replace(
            config.model, hf_checkpoint="", param_dtype="bfloat16"
        ).to_dict(),
        "skip": skip,
        "memory": None,
        "summary": summary,
    }


# -- the parts, in their own processes -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Context:
    """What a part's process knows: the target, its work directory and its deadline."""

    target: dict
    work_dir: Path
    deadline: float  # time.monotonic() by which the part should have returned

    @property
    def spec(self) -> dict | None:
        return self.target["spec"]

    @property
    def platform(self) -> str:
        return self.target["platform"]


def run_kernels(plan: dict, ctx: Context) -> dict:
    """Each case's max abs error against the float32 reference on the same bf16 inputs."""
    cases = []
    for case in plan["cases"]:
        check = train_attention_case if case["kind"] == "train_attention" else decode_case
        try:
            cases.append({**case, **check(case)})
        except Exception as e:  # one case's failure is its row; the others still run
            cases.append({**case, "within_tolerance": False, "error": f"{type(e).__name__}: {e}"})
    failures = [
        f"{c['kind']} {c['kernel']}: "
        + (c.get("error") or f"max abs error {c['max_abs_error']:.3g} over the tolerance")
        for c in cases
        if not c["within_tolerance"]
    ]
    errors = [c["max_abs_error"] for c in cases if "max_abs_error" in c]
    return {
        "cases": cases,
        "max_abs_error": max(errors) if errors else None,
        "atol": KERNEL_ATOL,
        "rtol": KERNEL_RTOL,
        "failures": failures,
    }


def _close(out, ref) -> dict:
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    error = float(np.max(np.abs(out - ref)))
    return {
        "max_abs_error": error,
        "max_abs_reference": float(np.max(np.abs(ref))),
        "within_tolerance": bool(np.allclose(out, ref, atol=KERNEL_ATOL, rtol=KERNEL_RTOL)),
    }


def train_attention_case(case: dict) -> dict:
    """Training attention of `case['kernel']` on bf16 q, k, v [batch, seq, heads, head_dim]
    against reference_attention on their float32 values: outputs and the gradients of
    sum(out · a random cotangent) with respect to q, k and v."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlax_tpu.models.attention import ATTENTION, reference_attention

    s = case["shape"]
    rng = np.random.default_rng(0)
    q_shape = (s["batch"], s["seq"], s["q_heads"], s["head_dim"])
    kv_shape = (s["batch"], s["seq"], s["kv_heads"], s["head_dim"])
    q, k, v = (
        jnp.asarray(rng.standard_normal(x), jnp.bfloat16) for x in (q_shape, kv_shape, kv_shape)
    )
    if case["kernel"] == "cudnn":  # cuDNN itself: the trainer's dot_product may fall back to XLA

        def kernel(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        kernel = ATTENTION[case["kernel"]]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out = jax.jit(kernel)(q, k, v)
    ref = jax.jit(reference_attention)(*f32)
    result = _close(out, ref)
    cotangent = jnp.asarray(rng.standard_normal(q_shape), jnp.float32)

    def grads(fn, args):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    grad_errors = {}
    for name, g, r in zip(
        "qkv", grads(kernel, (q, k, v)), grads(reference_attention, f32), strict=True
    ):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        scale = float(np.max(np.abs(r)))
        error = float(np.max(np.abs(g - r)))
        grad_errors[name] = {"max_abs_error": error, "max_abs_reference": scale}
        result["within_tolerance"] &= error <= KERNEL_RTOL * scale
    result["grads"] = grad_errors
    return result


def decode_case(case: dict) -> dict:
    """One query per slot over a paged pool (bf16 pages in shuffled order) through
    `case['kernel']` against paged_attention_jax (every page gathered, float32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlax_tpu.inference.attention import (
        paged_attention_jax,
        paged_decode_attention_gpu,
        paged_decode_attention_jax,
        paged_decode_attention_tpu,
    )

    s = case["shape"]
    rng = np.random.default_rng(0)
    slots, per_seq = s["slots"], s["pages_per_seq"]
    num_pages = slots * per_seq + 1  # page 0: padding
    pool = (s["kv_heads"], num_pages, s["page_size"], s["head_dim"])
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(pool), jnp.bfloat16) for _ in range(2))
    table = rng.permutation(np.arange(1, num_pages)).reshape(slots, per_seq)
    table = jnp.asarray(table, jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, s["q_heads"], s["head_dim"])), jnp.float32)
    lengths = jnp.asarray(s["lengths"], jnp.int32)
    kernel = {
        "jax": paged_decode_attention_jax,
        "pallas_gpu": paged_decode_attention_gpu,
        "pallas_tpu": paged_decode_attention_tpu,
    }[case["kernel"]]
    out = jax.jit(kernel)(q, k_pages, v_pages, table, lengths)
    ref = jax.jit(paged_attention_jax)(q[:, None], k_pages, v_pages, table, (lengths - 1)[:, None])
    return _close(out, ref[:, 0])


def run_decode(plan: dict, ctx: Context) -> dict:
    """Decode tokens/s per batch size and the HBM bandwidth it implies."""
    import jax
    import numpy as np
    from bench_inference import best_seconds
    from flax import nnx

    from rlax_tpu.config import InferenceConfig, ModelConfig
    from rlax_tpu.inference.attention import resolve_backend
    from rlax_tpu.inference.engine import Engine, GenerationRequest
    from rlax_tpu.inference.sampling import SamplingParams
    from rlax_tpu.models import Transformer
    from rlax_tpu.simulator.model import count_params, decode_flops_per_token

    model = ModelConfig.from_dict(plan["model"])
    inference = InferenceConfig.from_dict(plan["inference"])
    sizes, prompt_len = plan["batch_sizes"], plan["prompt_len"]
    short, long = plan["new_tokens"]
    params = nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(0)), nnx.Param))
    engine = Engine(model, inference, seed=0, decode_steps_per_call=plan["decode_steps_per_call"])
    engine.load(0, params)
    prompts = np.random.default_rng(0).integers(0, model.vocab_size, (max(sizes), prompt_len))
    base = SamplingParams.from_config(inference)

    def runner(batch: int, new: int) -> Callable[[], None]:
        sampling = dataclasses.replace(base, max_new_tokens=new, stop_token_ids=())
        requests = [
            GenerationRequest(f"b{batch}.{i}", f"p{i}", 0, tuple(map(int, prompts[i])), sampling)
            for i in range(batch)
        ]

        def run() -> None:
            rollouts = engine.run(requests)
            assert sum(len(r.tokens) for r in rollouts) == batch * new

        return run

    runs = {(b, n): runner(b, n) for b in sizes for n in (short, long)}
    t0 = time.perf_counter()
    for run in runs.values():
        run()  # warm-up: compiles the prefill and every decode size
    warmup_s = time.perf_counter() - t0
    seconds = best_seconds(runs, plan["repeats"])
    weights = count_params(model) * 2
    per_token = model.kv_bytes_per_token()
    context = prompt_len + (short + long) / 2
    spec = ctx.spec
    rows, failures = [], []
    for b in sizes:
        step_s = (seconds[b, long] - seconds[b, short]) / (long - short)
        if step_s <= 0:
            failures.append(f"batch {b}: the longer run was not slower (timing noise)")
            continue
        step_bytes = weights + b * context * per_token
        flops = decode_flops_per_token(model, context) * b
        rows.append(
            {
                "batch": b,
                "step_ms": round(1e3 * step_s, 3),
                "tokens_per_s": round(b / step_s, 1),
                "bytes_per_step": int(step_bytes),
                "hbm_bytes_per_s": round(step_bytes / step_s),
                "fraction_of_hbm_roofline": spec
                and round(step_bytes / step_s / spec["hbm_bytes_per_s"], 4),
                "roofline_tokens_per_s": spec
                and round(b * spec["hbm_bytes_per_s"] / step_bytes, 1),
                "model_flops_per_s": round(flops / step_s),
                "fraction_of_peak_flops": spec
                and round(flops / step_s / spec["peak_flops_per_s"], 4),
                "short_run_s": round(seconds[b, short], 4),
                "long_run_s": round(seconds[b, long], 4),
            }
        )
    backend = resolve_backend(
        inference.attention_backend,
        head_dim=model.head_dim,
        page_size=inference.page_size,
        dtype=jax.numpy.dtype(model.dtype),
    )
    return {
        "device": str(jax.devices()[0].device_kind),
        "attention_backend": backend,
        "weights_bytes": weights,
        "kv_bytes_per_token": per_token,
        "mean_context": context,
        "warmup_s": round(warmup_s, 1),
        "compiled": engine.stats()["compiled"],
        "batches": rows,
        "failures": failures,
    }


def run_trainer(plan: dict, ctx: Context) -> dict:
    """tools/bench_trainer.py's `bench` on the model; MFU against the chips' peak."""
    import bench_trainer
    import jax

    from rlax_tpu.config import ModelConfig
    from rlax_tpu.models.options import resolve_train_attention

    model = ModelConfig.from_dict(plan["model"])
    s = plan["shape"]
    # bench_trainer's batches all carry version 0, which its config's on-policy staleness
    # (max_staleness 0) refuses from step 1 on: step s's batch gets version s, as an
    # on-policy run's does.
    make_batch = bench_trainer._batch

    def on_policy_batch(config, seed: int, seq: int | None = None):
        batch = make_batch(config, seed, seq)
        return batch.replace(versions=jax.numpy.full_like(batch.versions, seed))

    bench_trainer._batch = on_policy_batch
    name = "device_check"  # bench_trainer's configs are a registry of named shapes
    bench_trainer.CONFIGS[name] = (
        model,
        s["prompts"],
        s["samples"],
        s["mini"],
        s["micro"],
        s["seq"],
    )
    figures = bench_trainer.bench(name, plan["steps"])
    # bench_trainer's own MFU is against a matmul it times; this one against the data sheet.
    figures["mfu_measured_matmul"] = figures.pop("mfu")
    flops = plan["model_flops_per_step"]
    spec = ctx.spec
    peak = spec and spec["peak_flops_per_s"] * figures["devices"]
    return {
        **figures,
        "mfu": peak and round(flops / figures["step_s"] / peak, 4),
        "model_flops_per_step": flops,
        "peak_flops_per_s": peak,
        "attention": resolve_train_attention("auto"),
        "device": str(jax.devices()[0].device_kind),
        "failures": [],
    }


def run_weight_sync(plan: dict, ctx: Context) -> dict:
    """Publish (device arrays, as the trainer's) to a parameter-server process, then
    InferenceWorker.load (pull + swap), version by version; medians after the first."""
    import secrets

    import jax
    from bench_param_server import start_param_server, stop
    from flax import nnx

    from rlax_tpu.config import InferenceConfig, ModelConfig, RunConfig
    from rlax_tpu.inference.worker import InferenceWorker
    from rlax_tpu.models import Transformer
    from rlax_tpu.param_server.trees import TreeClient

    model = ModelConfig.from_dict(plan["model"])
    served = model.served()
    params = nnx.to_pure_dict(nnx.state(Transformer(served, rngs=nnx.Rngs(0)), nnx.Param))
    # Each version other bytes (nothing can be deduplicated), made before its timing.
    shifted = jax.jit(lambda tree, v: jax.tree.map(lambda x: x + v.astype(x.dtype), tree))
    token = secrets.token_hex(16)
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=token, JAX_PLATFORMS="cpu")
    config = RunConfig(model=model, inference=InferenceConfig.from_dict(plan["inference"]))
    publishes, loads, sent = [], [], []
    server, address = start_param_server(str(ctx.work_dir / "params"), env)
    try:
        publisher = TreeClient([address], auth_token=token)
        worker_side = TreeClient([address], auth_token=token)
        worker = InferenceWorker(config, param_server=worker_side, consumer_id="device-check")
        for version in range(plan["versions"]):
            tree = jax.block_until_ready(shifted(params, jax.numpy.asarray(version)))
            t0 = time.perf_counter()
            receipt = publisher.publish(version, tree)
            t1 = time.perf_counter()
            worker.load(version)
            t2 = time.perf_counter()
            publishes.append(t1 - t0)
            loads.append(t2 - t1)
            sent.append(receipt.bytes_sent)
            publisher.wait_persisted([version])  # untimed: its storage copy, then older go
            publisher.garbage_collect(version)
        worker.close()
        publisher.close()
        worker_side.close()
    finally:
        stop(server)
    nbytes = plan["bytes"]
    publish_s, load_s = statistics.median(publishes[1:]), statistics.median(loads[1:])
    return {
        "bytes": nbytes,
        "bytes_sent": sent,
        "versions": len(publishes),
        "first_publish_s": round(publishes[0], 4),
        "first_load_s": round(loads[0], 4),
        "publish_s": round(publish_s, 4),
        "load_s": round(load_s, 4),
        "publish_bytes_per_s": round(nbytes / publish_s),
        "load_bytes_per_s": round(nbytes / load_s),
        "sync_s": round(publish_s + load_s, 4),
        "failures": [f"version {v} sent {n} bytes" for v, n in enumerate(sent) if n < nbytes],
    }


def write_gsm8k_rows(path: Path, count: int) -> None:
    """`count` rows in GSM8K's layout ({"question", "answer": "... #### N"})."""
    rows = []
    for i in range(count):
        a, b = 3 + i % 17, 2 + (7 * i) % 13
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# Qwen2.5-Instruct's ChatML, with its default system message.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(directory: Path, corpus: Sequence[str], vocab_size: int) -> None:
    """A byte-level BPE tokenizer with Qwen's special tokens and chat template, trained on
    `corpus` (ids past it in the model's vocabulary decode to nothing, as Qwen's own
    151,936-row embedding has ids its tokenizer never makes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1024),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(corpus) * 4, trainer)
    backend.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    settings["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    eos = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    generation = {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": True}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))


def run_gsm8k(plan: dict, ctx: Context) -> dict:
    """The recipe's first RL steps through `rlax-tpu run`, stopped (Ctrl-C: a clean stop) at
    the part's deadline; the step times from the run's metrics.jsonl."""
    run_env = dict(os.environ)  # the run's trainer and worker get the accelerator
    if ctx.platform == "cpu":
        run_env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
    # This process writes the checkpoint on the CPU: it must hold no accelerator memory while
    # the run's trainer and worker take their shares of it.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from flax import nnx

    from rlax_tpu.config import ModelConfig
    from rlax_tpu.models import Transformer
    from rlax_tpu.models.hf import save_hf

    work = ctx.work_dir
    paths = {k: str(work / k) for k in ("checkpoint", "run_dir")}
    paths["data"] = str(work / "gsm8k_train.jsonl")
    t0 = time.perf_counter()
    model = ModelConfig.from_dict(plan["checkpoint_model"])
    save_hf(Transformer(model, rngs=nnx.Rngs(0)), model, paths["checkpoint"])
    write_gsm8k_rows(Path(paths["data"]), plan["rows"])
    rows = [json.loads(line) for line in Path(paths["data"]).read_text().splitlines()]
    corpus = [r["question"] + " " + r["answer"] for r in rows] + [CHAT_TEMPLATE]
    write_tokenizer(Path(paths["checkpoint"]), corpus, model.vocab_size)
    checkpoint_s = time.perf_counter() - t0

    sets = [s.format(**paths) for s in plan["sets"]]
    command = [sys.executable, "-m", "rlax_tpu", "run", str(ROOT / plan["recipe"])]
    command += [x for s in sets for x in ("--set", s)]
    print("$", " ".join(command), flush=True)
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its components too: stopped as one group at the deadline
    )

    def stop_now(signum: int, frame: Any) -> None:  # the check stops this part: the run too
        stop_group(process, grace_s=5)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop_now)
    lines: list[str] = []
    reader = threading.Thread(target=_echo, args=(process.stdout, lines, "  run| "), daemon=True)
    reader.start()
    stopped_at_deadline = False
    try:  # stopped 40 s before the deadline: 25 s to stop cleanly, 5 more to be killed
        process.wait(timeout=max(1.0, ctx.deadline - time.monotonic() - 40))
    except subprocess.TimeoutExpired:
        stopped_at_deadline = True
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the run stops cleanly
        try:
            process.wait(timeout=25)
        except subprocess.TimeoutExpired:
            stop_group(process, grace_s=5)
    reader.join(timeout=10)
    wall_s = time.monotonic() - start
    steps = _step_times(Path(paths["run_dir"]) / "metrics.jsonl")
    failures = []
    if stopped_at_deadline:
        failures.append(f"stopped at the part's share of the budget after {len(steps)} steps")
    elif process.returncode != 0:
        failures.append(f"rlax-tpu run exited with code {process.returncode}")
    if len(steps) < plan["steps"] and not failures:
        failures.append(f"{len(steps)} of {plan['steps']} steps in metrics.jsonl")
    step_s = [s["time/controller_step_s"] for s in steps if "time/controller_step_s" in s]
    return {
        "recipe": plan["recipe"],
        "sets": sets,
        "checkpoint_s": round(checkpoint_s, 1),
        "wall_s": round(wall_s, 1),
        "returncode": process.returncode,
        "steps_done": len(steps),
        "steps": steps,
        "step_s": [round(s, 2) for s in step_s],
        "log_tail": last_lines("\n".join(lines), 30) if failures else "",
        "failures": failures,
    }


def _echo(stream, lines: list[str], prefix: str) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        print(prefix + lines[-1], flush=True)


def _step_times(metrics: Path) -> list[dict]:
    """Each RL step's row of a run's metrics.jsonl: its times, reward and tokens/s."""
    if not metrics.is_file():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "reward_mean" not in row:
            continue
        keep = {
            k: v for k, v in row.items() if k.startswith("time/") or k in ("step", "reward_mean")
        }
        steps.append(keep)
    return steps


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    what: str
    plan: Callable[[Target, Options], dict]
    run: Callable[[dict, Context], dict]


PARTS = {
    p.name: p
    for p in (
        Part("kernels", "attention kernels against the reference", plan_kernels, run_kernels),
        Part("decode", "engine decode tokens/s and HBM bandwidth", plan_decode, run_decode),
        Part("trainer", "trainer step MFU", plan_trainer, run_trainer),
        Part(
            "weight_sync",
            "publish + pull through the parameter server",
            plan_weight_sync,
            run_weight_sync,
        ),
        Part("gsm8k", "the GSM8K recipe's first RL steps", plan_gsm8k, run_gsm8k),
    )
}
assert tuple(PARTS) == PART_ORDER


# -- the report ------------------------------------------------------------------------------------
def new_report(target: Target, install: dict, plans: dict, budget_s: float, dry_run: bool) -> dict:
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": dry_run,
        "target": target.to_json(),
        "install": install,
        "budget_s": budget_s,
        "elapsed_s": None,
        "parts": {
            name: {
                "status": "skipped" if plan.get("skip") else "planned",
                "plan": plan,
                "result": None,
                "error": plan.get("skip") or None,
                "seconds": None,
            }
            for name, plan in plans.items()
        },
        "markdown_row": None,
    }


# key -> the type(s) its value has (None: null allowed); nested for target and install.
_REPORT_KEYS = {
    "schema": str,
    "created": str,
    "dry_run": bool,
    "target": dict,
    "install": dict,
    "budget_s": (int, float),
    "elapsed_s": (int, float, type(None)),
    "parts": dict,
    "markdown_row": (str, type(None)),
}
_TARGET_KEYS = {
    "platform": str,
    "evidence": str,
    "chip": (str, type(None)),
    "chip_source": str,
    "devices": int,
    "tiny": bool,
    "device_kind": str,
    "jax": str,
    "spec": (dict, type(None)),
}
_INSTALL_KEYS = {
    "command": list,
    "extra": (str, type(None)),
    "requirements": list,
    "status": str,
    "seconds": (int, float, type(None)),
    "detail": str,
}
_PART_KEYS = {
    "status": str,
    "plan": dict,
    "result": (dict, type(None)),
    "error": (str, type(None)),
    "seconds": (int, float, type(None)),
}


def _check_keys(where: str, data: Mapping, keys: Mapping[str, Any]) -> None:
    for key, types in keys.items():
        if key not in data:
            raise ReportSchemaError(f"{where}: key {key!r} is missing")
        if not isinstance(data[key], types):
            raise ReportSchemaError(f"{where}.{key}: {type(data[key]).__name__} is not {types}")


def check_report(report: Mapping) -> None:
    """ReportSchemaError unless `report` has SCHEMA's shape: every key, its type, a known
    status per part, a result for each part that ran, an error for each that failed, and the
    whole of it JSON."""
    _check_keys("report", report, _REPORT_KEYS)
    if report["schema"] != SCHEMA:
        raise ReportSchemaError(f"report.schema is {report['schema']!r}, not {SCHEMA!r}")
    _check_keys("report.target", report["target"], _TARGET_KEYS)
    if report["target"]["platform"] not in PLATFORMS:
        raise ReportSchemaError(f"report.target.platform {report['target']['platform']!r}")
    _check_keys("report.install", report["install"], _INSTALL_KEYS)
    if not report["parts"]:
        raise ReportSchemaError("report.parts is empty")
    for name, part in report["parts"].items():
        where = f"report.parts.{name}"
        if name not in PARTS:
            raise ReportSchemaError(f"{where}: no such part")
        _check_keys(where, part, _PART_KEYS)
        status = part["status"]
        if status not in STATUSES:
            raise ReportSchemaError(f"{where}.status {status!r} is not one of {STATUSES}")
        if status == "ok" and part["result"] is None:
            raise ReportSchemaError(f"{where}: status ok without a result")
        if status in ("failed", "skipped") and not part["error"]:
            raise ReportSchemaError(f"{where}: status {status} without an error saying why")
        if "summary" not in part["plan"]:
            raise ReportSchemaError(f"{where}.plan: key 'summary' is missing")
    try:
        json.dumps(report, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ReportSchemaError(f"report is not JSON: {e}") from None


def markdown_row(report: Mapping) -> str:
    """A row of docs/gpu_tpu_recipes.md's "Measured on" table (MARKDOWN_HEADER)."""
    target, parts = report["target"], report["parts"]

    def result(name: str) -> dict | None:
        part = parts.get(name)
        return part["result"] if part and part["status"] == "ok" else None

    def absent(name: str) -> str:
        part = parts.get(name)
        return "not run" if part is None else part["status"]

    device = target["device_kind"] or target["platform"]
    device += f" × {target['devices']}" + (f" ({target['chip']})" if target["chip"] else "")
    if target["tiny"]:
        device += ", --tiny"
    software = f"jax {target['jax']}" if target["jax"] else "—"
    decode = result("decode")
    if decode:
        cells = []
        for row in decode["batches"]:
            share = row["fraction_of_hbm_roofline"]
            cells.append(
                f"{row['batch']}: {row['tokens_per_s']:,.0f}"
                + (f" ({share:.0%})" if share is not None else "")
            )
        decode_cell = " · ".join(cells)
    else:
        decode_cell = absent("decode")
    trainer = result("trainer")
    if trainer and trainer["mfu"] is not None:
        trainer_cell = f"{trainer['mfu']:.1%}"
    elif trainer:  # no chip-table peak: against the matmul bench_trainer times
        trainer_cell = f"{trainer['mfu_measured_matmul']:.1%} of a timed matmul"
    else:
        trainer_cell = absent("trainer")
    kernels = parts.get("kernels")
    if kernels and kernels["result"]:
        k = kernels["result"]
        verdict = "all within" if kernels["status"] == "ok" else "NOT all within"
        kernels_cell = f"{k['max_abs_error']:.1e} ({verdict} {KERNEL_ATOL:g})"
    else:
        kernels_cell = absent("kernels")
    gsm8k = parts.get("gsm8k")
    if gsm8k and gsm8k["result"] and gsm8k["result"]["step_s"]:
        g = gsm8k["result"]
        gsm8k_cell = ", ".join(f"{s:.1f}" for s in g["step_s"])
        if g["steps_done"] < STEPS:
            gsm8k_cell += f" ({g['steps_done']} of {STEPS} steps)"
    else:
        gsm8k_cell = absent("gsm8k")
    sync = result("weight_sync")
    sync_cell = (
        f"{sync['publish_s']:.2f} + {sync['load_s']:.2f} s ({gib(sync['bytes'])})"
        if sync
        else absent("weight_sync")
    )
    date = report["created"][:10]
    cells = [date, device, software, decode_cell, trainer_cell, kernels_cell, gsm8k_cell, sync_cell]
    return "| " + " | ".join(cells) + " |"


def print_plan(report: Mapping) -> None:
    target, install = report["target"], report["install"]
    spec = target["spec"]
    print(f"platform  {target['platform']} ({target['evidence']})")
    if spec:
        print(
            f"chip      {target['chip']} ({target['chip_source']}): {gib(spec['hbm_bytes'])}, "
            f"{spec['peak_flops_per_s'] / 1e12:.0f} TFLOP/s bf16, "
            f"{spec['hbm_bytes_per_s'] / 1e9:.0f} GB/s"
        )
    else:
        print(f"chip      none ({target['chip_source']})")
    print(f"devices   {target['devices']}" + ("" if target["jax"] else " (assumed: --devices)"))
    extra = (
        f" (extra {install['extra']}: {', '.join(install['requirements'])})"
        if install["extra"]
        else ""
    )
    print(f"install   {shlex.join(install['command'])}{extra}")
    print("          run unless JAX already runs on the platform (--install auto)")
    print(f"budget    {report['budget_s']:.0f} s; each part in its own process, in this order:")
    for name, part in report["parts"].items():
        print(f"  {name:<12}{PARTS[name].what}")
        for line in part["plan"]["summary"]:
            print(f"  {'':<12}- {line}")


# -- running the parts -----------------------------------------------------------------------------
def part_env(platform: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS=JAX_PLATFORMS[platform], PYTHONUNBUFFERED="1")
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # bench_trainer asks for 8
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=1".strip()
    return env


def run_part(name: str, plan: dict, target: Target, work: Path, timeout_s: float) -> dict:
    """Part `name` in a process of its own (its own session: the group is killed past
    `timeout_s`): its status, result, error and seconds."""
    part_dir = work / name
    part_dir.mkdir(parents=True, exist_ok=True)
    given, taken = part_dir / "input.json", part_dir / "output.json"
    given.write_text(json.dumps({"target": target.to_json(), "plan": plan, "timeout_s": timeout_s}))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        str(given),
        str(taken),
    ]
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=part_env(target.platform),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(
        target=_echo, args=(process.stdout, lines, f"  [{name}] "), daemon=True
    )
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(process)
    except KeyboardInterrupt:  # its own session: the terminal's Ctrl-C did not reach it
        stop_group(process)
        raise
    reader.join(timeout=10)
    seconds = round(time.monotonic() - start, 1)
    (part_dir / "log.txt").write_text("\n".join(lines) + "\n")
    if taken.is_file():
        out = json.loads(taken.read_text())
        return {**out, "seconds": seconds}
    why = (
        f"ran past its {timeout_s:.0f} s share of the budget"
        if timed_out
        else f"its process exited with code {process.returncode} and wrote no result"
    )
    return {
        "status": "failed",
        "result": None,
        "error": f"{why}; its last lines:\n{last_lines(chr(10).join(lines), 25)}",
        "seconds": seconds,
    }


def stop_group(process: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM to the process group `process` leads (it was started in a session of its
    own), SIGKILL if it has not exited within `grace_s`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        process.wait()


def child_main(name: str, given: Path, taken: Path) -> int:
    """A part's process: run it, write {status, result, error}; 0 when it passed."""
    data = json.loads(given.read_text())
    ctx = Context(
        target=data["target"],
        work_dir=given.parent,
        deadline=time.monotonic() + data["timeout_s"],
    )
    try:
        result = PARTS[name].run(data["plan"], ctx)
    except Exception as e:
        trace = traceback.format_exc()
        print(trace, file=sys.stderr, flush=True)
        error = f"{type(e).__name__}: {e}\n{last_lines(trace, 25)}"
        out = {"status": "failed", "result": None, "error": error}
    else:
        failures = result.get("failures", [])
        status = "failed" if failures else "ok"
        out = {"status": status, "result": result, "error": "; ".join(failures) or None}
    taken.write_text(json.dumps(out, indent=2, default=str))
    return 0 if out["status"] == "ok" else 1


def last_lines(text: str, count: int) -> str:
    return "\n".join([line for line in text.splitlines() if line.strip()][-count:])


def parse_parts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise PlanError(
            f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(PART_ORDER)}"
        )
    return [n for n in PART_ORDER if n in names]


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="device_check.py",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Writes a JSON report (--json) and prints a row of docs/gpu_tpu_recipes.md's "
        "'Measured on' table. Exit status: 0 every part passed (or cannot run on this "
        "platform), 1 a part failed or the budget left it out, 2 the plan is invalid (nothing "
        "ran).",
    )
    parser.add_argument("--platform", choices=PLATFORMS, help="default: detected on this host")
    parser.add_argument(
        "--chip",
        help="the chip-table entry (h100, h200, v5e, ...); default: "
        "what JAX reports, or in a dry run elsewhere the recipe's",
    )
    parser.add_argument(
        "--devices",
        type=int,
        help="chips the plan assumes in a dry run "
        "(default: the recipe's: 1 GPU, 4 TPU chips); a real run counts them",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PART_ORDER),
        help=f"comma-separated subset of {','.join(PART_ORDER)} (default all)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=600.0,
        help="the whole check's time budget in seconds, the install included "
        "(default 600); a part gets at most what is left",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="write the report here (default "
        "device_check_PLATFORM.json in a real run; none in a dry run)",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the GSM8K recipe's run, after the check's "
        "own (e.g. inference.max_new_tokens=1024 --set trainer.max_seq_len=1536)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=parse_batch_sizes,
        help="decode batch sizes (default 1,16,64,256; --tiny 1,4)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="decode steps per engine call (default 1, as a rollout worker)",
    )
    parser.add_argument(
        "--trainer-micro-batch",
        type=int,
        help="the trainer part's micro-batch (default 8; --tiny 2)",
    )
    parser.add_argument(
        "--install",
        choices=("auto", "always", "never"),
        default="auto",
        help="pip install -e '.[EXTRA]' first: auto (unless JAX already runs on "
        "the platform), always, never",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the plan and print it; measure nothing (any host)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every part at a CPU's size (with --platform cpu: a smoke run)",
    )
    parser.add_argument(
        "--keep-work-dir",
        action="store_true",
        help="keep the checkpoint, run directory and logs (printed at the end)",
    )
    parser.add_argument("--child", nargs=3, metavar=("PART", "IN", "OUT"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        name, given, taken = args.child
        return child_main(name, Path(given), Path(taken))
    try:
        return check(args)
    except PlanError as e:
        print(f"device_check: {e}", file=sys.stderr)
        return 2


def check(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.platform:
        platform, evidence = args.platform, "--platform"
    else:
        platform, evidence = detect_platform()
    names = parse_parts(args.parts)
    if args.decode_steps < 1:
        raise PlanError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    install = install_plan(platform)
    seen = None
    if args.dry_run:
        try:
            import rlax_tpu.config  # noqa: F401  (the plans need the package's dependencies)
        except ImportError as e:
            raise PlanError(
                f"a dry run needs the package installed ({e}): {shlex.join(install['command'])}"
            ) from None
    else:
        try:
            seen = ensure_installed(platform, install, args.install)
        except PlanError as e:
            print(f"device_check: {e}", file=sys.stderr)
            return 1
    target = resolve_target(platform, evidence, args, seen)
    options = Options(
        batch_sizes=args.batch_sizes,
        sets=tuple(args.sets),
        trainer_micro_batch=args.trainer_micro_batch,
        decode_steps=args.decode_steps,
    )
    plans = {name: PARTS[name].plan(target, options) for name in names}
    report = new_report(target, install, plans, args.budget_s, args.dry_run)
    check_report(report)
    print_plan(report)
    if args.dry_run:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"dry run: the plan is valid (report schema {SCHEMA} checked); nothing was measured")
        return 0

    work = Path(tempfile.mkdtemp(prefix="rlax-device-check-"))
    try:
        for name in names:
            part = report["parts"][name]
            if part["status"] == "skipped":
                print(f"{name}: skipped: {part['error']}")
                continue
            left = args.budget_s - (time.monotonic() - started)
            if left < MIN_PART_S:
                part.update(status="skipped", error=f"the budget was spent ({left:.0f} s left)")
                print(f"{name}: skipped: {part['error']}")
                continue
            print(f"{name}: running (at most {min(PART_CAPS_S[name], left):.0f} s)", flush=True)
            part.update(run_part(name, part["plan"], target, work, min(PART_CAPS_S[name], left)))
            print(
                f"{name}: {part['status']} in {part['seconds']:.1f} s"
                + (f": {part['error'].splitlines()[0]}" if part["error"] else ""),
                flush=True,
            )
    finally:
        if args.keep_work_dir:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["markdown_row"] = markdown_row(report)
    check_report(report)
    out = args.json or Path(f"device_check_{platform}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)
    print(f"report: {out}")
    print("Measured on (docs/gpu_tpu_recipes.md):")
    print(MARKDOWN_HEADER)
    print(markdown_row(report))
    # A part skipped for the budget was not measured; one skipped on a TPU host cannot be.
    failed = [n for n, p in report["parts"].items() if p["status"] == "failed"]
    unmeasured = [n for n, p in report["parts"].items() if "budget" in (p["error"] or "")]
    return 1 if failed or unmeasured else 0


def print_summary(report: Mapping) -> None:
    print(f"done in {report['elapsed_s']:.0f} s of {report['budget_s']:.0f}:")
    for name, part in report["parts"].items():
        r = part["result"] or {}
        line = f"  {name:<12}{part['status']}"
        if name == "decode" and r.get("batches"):
            line += "; " + ", ".join(
                f"batch {b['batch']}: {b['tokens_per_s']:,.0f} tok/s, {b['step_ms']:.2f} ms/step"
                + (
                    f" ({b['fraction_of_hbm_roofline']:.0%} of HBM)"
                    if b["fraction_of_hbm_roofline"] is not None
                    else ""
                )
                for b in r["batches"]
            )
        elif name == "trainer" and r:
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a (no chip)"
            line += f"; step {r['step_s']:.3f} s, {r['tokens_per_s']:,.0f} tok/s, MFU {mfu}"
        elif name == "kernels" and r:
            line += f"; max abs error {r['max_abs_error']:.2e} (tolerance {KERNEL_ATOL:g})"
        elif name == "weight_sync" and r:
            line += f"; publish {r['publish_s']:.3f} s + load {r['load_s']:.3f} s"
            line += f" of {gib(r['bytes'])}"
        elif name == "gsm8k" and r:
            line += f"; {r['steps_done']} steps, step s {r['step_s']}"
        if part["error"]:
            line += f"; {part['error'].splitlines()[0]}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
