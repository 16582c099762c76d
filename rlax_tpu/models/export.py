"""A policy as a complete Hugging Face model directory: weights and config.json (`save_hf`),
the tokenizer's own files, and generation_config.json with its bos, eos and pad ids.

`rlax-tpu export` (cli/export.py) writes one from a run's checkpoint, and the SFT warm start
(launch/job.py) writes RUN_DIR/sft_model with it, so either loads with transformers'
AutoModelForCausalLM and AutoTokenizer, and `generate()` stops on the tokens the run's
rollouts stopped on. A LoRA run's policy is written as PEFT loads it (`export_peft`: a PEFT
adapter directory and the base it applies to), or with its adapters folded into the base
(`export_merged`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tpu import storage
from rlax_tpu.config import ModelConfig
from rlax_tpu.data.tokenizer import GENERATION_CONFIG_FILE, Tokenizer
from rlax_tpu.models import lora
from rlax_tpu.models.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    CheckpointError,
    save_hf,
    save_peft_adapter,
)
from rlax_tpu.models.transformer import unstack_layers

# The files a tokenizer directory may hold, copied as they are when present (a checkpoint
# directory also holds weights, so the directory is not copied whole). The chat template
# lives in chat_template.jinja (chat_template.json in older saves) or in
# tokenizer_config.json; both travel.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# Written by transformers when a generation config was derived from a model's config.json;
# this one is not.
_DERIVED_MARKER = "_from_model_config"
# Where a PEFT adapter directory written by `export_peft` holds the base model it applies to.
BASE_DIR = "base"


def export_hf(
    params: Any,
    model_config: ModelConfig,
    out: str,
    *,
    tokenizer_dir: str | None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write the model `params` (a pure dict, per layer or scan-stacked; cast to
    `model_config.param_dtype`) to the directory `out` (local or gs://) in Hugging Face
    format, with the tokenizer files of `tokenizer_dir` and a generation_config.json.

    generation_config.json keeps the generation settings (temperature, top_p, ...) of the
    source's own generation_config.json (the tokenizer directory's, else the one in
    `model_config.hf_checkpoint`) and sets bos_token_id, pad_token_id and eos_token_id —
    every stop token: the tokenizer's eos_token_ids, which include the source's.
    config.json is written last (by save_hf), so its presence means the export is complete.
    A PEFT adapter's files that an earlier export left in `out` are removed: transformers
    would apply that adapter to these weights. Returns the files written.
    """
    storage.makedirs(out)
    for name in (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE):
        if storage.exists(stale := storage.join(out, name)):
            storage.remove(stale)
    written: list[str] = []
    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = Tokenizer.load(tokenizer_dir)  # refuses a directory without tokenizer.json
        written += _copy_tokenizer_files(tokenizer_dir, out)
    source = _source_generation_config([tokenizer_dir, model_config.hf_checkpoint])
    generation = generation_config(tokenizer, source)
    generation_url = storage.join(out, GENERATION_CONFIG_FILE)
    storage.write_text(generation_url, json.dumps(generation, indent=2, sort_keys=True) + "\n")
    written.append(generation_url)
    return written + save_hf(params, model_config, out, max_shard_bytes=max_shard_bytes)


def export_peft(
    params: Any,
    model_config: ModelConfig,
    out: str,
    *,
    tokenizer_dir: str | None,
    base_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write a LoRA model (`params` with adapters, `model_config.lora`) as PEFT loads it: the
    directory `out` is a PEFT adapter (adapter_model.safetensors, adapter_config.json and the
    tokenizer's files), and `base_dir` (default OUT/base) the base the adapters apply to, a
    whole model directory as `export_hf` writes it, which adapter_config.json names as
    base_model_name_or_path.

    A LoRA run's base is its own (an SFT warm start trains it), so it is written, not
    named: `peft.AutoPeftModelForCausalLM.from_pretrained(out)` loads base and adapters
    while the base is where it was written, and `peft.PeftModel.from_pretrained(
    AutoModelForCausalLM.from_pretrained(base_dir), out)` wherever the two are moved.
    adapter_config.json is written last: its presence means the export is complete.
    Returns the files written.
    """
    base_dir = base_dir if base_dir is not None else storage.join(out, BASE_DIR)
    base = lora.split(params)[1]
    written = export_hf(
        base, model_config, base_dir, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes
    )
    storage.makedirs(out)
    if tokenizer_dir is not None:
        written += _copy_tokenizer_files(tokenizer_dir, out)
    return written + save_peft_adapter(params, model_config, out, base_model=base_dir)


def export_merged(
    params: Any,
    model_config: ModelConfig,
    out: str,
    *,
    tokenizer_dir: str | None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """`export_hf` of a LoRA model (`model_config.lora`) with its adapters folded into the
    weights they adapt (`lora.merged`: W + (alpha / rank)·A·B, in model.param_dtype): a
    plain model that needs no PEFT. `params` per layer or scan-stacked."""
    if model_config.lora is None:
        raise CheckpointError("the model has no LoRA adapters to merge (model.lora is unset)")
    merged = lora.merged(unstack_layers(params), model_config.lora.scale)
    return export_hf(
        merged, model_config, out, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes
    )


def _copy_tokenizer_files(tokenizer_dir: str, out: str) -> list[str]:
    """Copy the TOKENIZER_FILES that `tokenizer_dir` has into `out`; returns the copies."""
    written = []
    for name in TOKENIZER_FILES:
        src, dst = storage.join(tokenizer_dir, name), storage.join(out, name)
        if storage.exists(src) and src != dst:
            storage.copy(src, dst)
            written.append(dst)
    return written


def generation_config(
    tokenizer: Tokenizer | None, source: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """generation_config.json's content: the `source` file's settings, with the token ids
    of `tokenizer` (bos and pad where it names them, else the source's; eos: all of the
    tokenizer's stop tokens, then any other of the source's). An id that neither names is
    left out; one eos id is written as an int, several as a list."""
    config = {k: v for k, v in (source or {}).items() if k != _DERIVED_MARKER}
    eos = list(tokenizer.eos_token_ids) if tokenizer is not None else []
    eos += [i for i in _ids(config.get("eos_token_id")) if i not in eos]
    ids = {
        "bos_token_id": tokenizer.bos_token_id if tokenizer is not None else None,
        "pad_token_id": tokenizer.pad_token_id if tokenizer is not None else None,
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
    }
    for key, value in ids.items():
        if value is None:
            value = config.get(key)
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def _source_generation_config(directories: Sequence[str | None]) -> dict[str, Any] | None:
    """The first generation_config.json among `directories` (None entries skipped)."""
    for directory in directories:
        if not directory:
            continue
        url = storage.join(directory, GENERATION_CONFIG_FILE)
        if storage.exists(url):
            try:
                return json.loads(storage.read_text(url))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{url} is not valid JSON: {e}") from None
    return None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(i) for i in value]
