"""Start-up loads a Hugging Face checkpoint straight into the trainer's sharding (issue 37):
no device holds more than its own shards at any point of the load, no device ever holds a
whole sharded parameter, each HF row is read once, and the result is bit for bit the host
reference (`load_hf_params`), with scanned (stacked) layers or without, in one process or
in two processes that each read only their devices' part.

The checkpoint is a tiny random Qwen2 saved by transformers itself (hf_fixtures); the mesh
is data=1, fsdp=4, tensor=2 over the 8 virtual CPU devices of conftest.py. CPU devices
report no memory_stats(), so the device bytes are counted from the shards of every live
jax.Array, sampled at every read of the checkpoint and every placement the load makes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from hf_fixtures import save_qwen_checkpoint
from trainer_helpers import run_config

from rlax_tpu import storage
from rlax_tpu.config import AlgorithmConfig, InferenceConfig, KLConfig, MeshConfig
from rlax_tpu.config.checkpoint import CheckpointMismatchError
from rlax_tpu.inference.engine import Engine
from rlax_tpu.models import hf
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer import trainer as trainer_module
from rlax_tpu.trainer.programs import TrainerPrograms

MESH = MeshConfig(data=1, fsdp=4, tensor=2)
# Host memory the load's Python objects take besides its buffers (headers, index maps).
HOST_SLACK_BYTES = 128 * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_qwen_checkpoint(tmp_path_factory.mktemp("qwen2"))


def _config(checkpoint: str, run_dir: str, *, scan_layers: bool, value_head: bool = False):
    """A trainer run on `checkpoint` over MESH. No KL term: nothing keeps a reference copy,
    so the load is the only thing in initialize() that places arrays."""
    model = hf.load_hf_config(
        checkpoint, param_dtype="float32", dtype="float32", value_head=value_head
    )
    return run_config(
        run_dir,
        mesh=MESH,
        model=model,
        algorithm=AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.0)),
        scan_layers=scan_layers,
    )


def _data_start(checkpoint: str) -> int:
    """The byte offset of the first tensor's data in model.safetensors (after the header)."""
    url = storage.join(checkpoint, "model.safetensors")
    (header_len,) = np.frombuffer(storage.read_range(url, 0, 8), "<u8")
    return 8 + int(header_len)


def _tensor_bytes(checkpoint: str) -> dict[str, int]:
    tensors = safetensors.numpy.load_file(os.path.join(checkpoint, "model.safetensors"))
    return {name: x.nbytes for name, x in tensors.items()}


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


class LoadWatch:
    """Device memory, host memory and checkpoint reads during a load, by instrumenting its
    public seams: every `storage.read_range` (the only way bytes leave the checkpoint) and
    every `jax.device_put` / `jax.make_array_from_callback` /
    `jax.make_array_from_single_device_arrays` (the ways host data reaches a device) samples
    the per-device bytes of every jax.Array alive then, besides those alive when the watch
    began.

    Host memory is traced (tracemalloc sees numpy buffers and bytes objects) between
    placements: `host_peaks` holds, for each stretch from one placement to the next, its
    peak above where it began: what one placement needed on the host. (Per stretch because
    on CPU a placed shard may keep its host buffer as the device buffer.)"""

    def __init__(self, monkeypatch, sharded_shapes: set[tuple[int, ...]]):
        tracemalloc.start()
        self.host_peaks: list[int] = []
        self._host_start = tracemalloc.get_traced_memory()[0]
        self._before = list(jax.live_arrays())  # held, so their ids stay theirs
        self._before_ids = {id(a) for a in self._before}
        self.sharded_shapes = sharded_shapes  # full shapes of the params not replicated
        self.peak: collections.Counter = collections.Counter()
        self.whole_on_one_device: list[tuple[int, ...]] = []
        self.reads: list[tuple[int, int]] = []  # (start, length) of every ranged read
        self.callback_buffers: list[tuple[int, int]] = []  # (bytes returned, shard bytes)
        read_range = storage.read_range

        def watched_read(url, start, length):
            self.sample()
            self.reads.append((start, length))
            return read_range(url, start, length)

        monkeypatch.setattr(storage, "read_range", watched_read)
        for name in ("device_put", "make_array_from_single_device_arrays"):
            monkeypatch.setattr(jax, name, self._sampled(getattr(jax, name)))
        from_callback = jax.make_array_from_callback

        def watched_from_callback(shape, sharding, data_callback, dtype=None):
            shard_size = math.prod(sharding.shard_shape(tuple(shape)))

            def callback(index):
                data = np.asarray(data_callback(index))
                self.callback_buffers.append((data.nbytes, shard_size * data.dtype.itemsize))
                return data

            return self._sampled(from_callback)(shape, sharding, callback, dtype=dtype)

        monkeypatch.setattr(jax, "make_array_from_callback", watched_from_callback)

    def _sampled(self, fn):
        def wrapped(*args, **kwargs):
            self.sample()
            out = fn(*args, **kwargs)
            self.sample()
            self._host_stretch()
            return out

        return wrapped

    def _host_stretch(self) -> None:
        current, peak = tracemalloc.get_traced_memory()
        self.host_peaks.append(peak - self._host_start)
        tracemalloc.reset_peak()
        self._host_start = current

    def close(self) -> None:
        tracemalloc.stop()

    def sample(self) -> None:
        held: collections.Counter = collections.Counter()
        for array in jax.live_arrays():
            if id(array) in self._before_ids or array.is_deleted():
                continue
            devices = array.sharding.device_set
            if len(devices) == 1 and tuple(array.shape) in self.sharded_shapes:
                self.whole_on_one_device.append(tuple(array.shape))
            for device in devices:
                held[device] += _shard_bytes(array)
        for device, nbytes in held.items():
            self.peak[device] = max(self.peak[device], nbytes)


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, k))
        else:
            yield (*prefix, k), v


@pytest.mark.parametrize("scan_layers", [False, True], ids=["per_layer", "scanned"])
def test_trainer_start_up_loads_each_device_only_its_shards(
    checkpoint, tmp_path, monkeypatch, scan_layers
):
    config = _config(checkpoint, str(tmp_path / "run"), scan_layers=scan_layers)
    trainer = Trainer(config)
    target = trainer.programs.abstract_params
    sharded = {
        tuple(x.shape) for x in jax.tree.leaves(target) if not x.sharding.is_fully_replicated
    }
    loaded = []
    load = trainer_module.load_hf_sharded

    def recording_load(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(trainer_module, "load_hf_sharded", recording_load)
    watch = LoadWatch(monkeypatch, sharded)
    try:
        trainer.initialize()
    finally:
        watch.close()
        monkeypatch.undo()

    # (c) Device memory: at every sample, each device held at most its own shards of the
    # params (the final layout; nothing else is placed) plus one shard in flight.
    final: collections.Counter = collections.Counter()
    for x in jax.tree.leaves(target):
        for device in x.sharding.device_set:
            final[device] += _shard_bytes(x)
    largest_shard = max(_shard_bytes(x) for x in jax.tree.leaves(target))
    over = {
        str(d): (watch.peak[d], final[d]) for d in final if watch.peak[d] > final[d] + largest_shard
    }
    assert not over, f"devices held more than their shards (peak, shards): {over}"
    assert not watch.whole_on_one_device, (
        f"whole sharded params sat on one device: {sorted(set(watch.whole_on_one_device))}"
    )
    assert watch.callback_buffers, "nothing went through make_array_from_callback"
    assert all(got == shard for got, shard in watch.callback_buffers), watch.callback_buffers

    # Reads: each HF row once (the data bytes read add up to the checkpoint's), in blocks of
    # at most MAX_READ_BYTES; host memory (numpy and bytes objects, traced) at most this
    # process's shards of one parameter (here, all 8 devices': the parameter) plus one block.
    start = _data_start(checkpoint)
    data_reads = [length for offset, length in watch.reads if offset >= start]
    sizes = _tensor_bytes(checkpoint)
    assert sum(data_reads) == sum(sizes.values())
    assert max(data_reads) <= hf.MAX_READ_BYTES
    largest_param = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(target))
    host_peak = max(watch.host_peaks)
    assert host_peak <= largest_param + max(data_reads) + HOST_SLACK_BYTES, watch.host_peaks

    # (a) Exactly the host reference, (b) in the trainer's target sharding.
    reference = hf.load_hf_params(checkpoint, config.model)
    jax.tree.map(np.testing.assert_array_equal, trainer.params(), reference)
    (params,) = loaded
    targets = dict(_flat(trainer.programs.param_shardings))
    for path, x in _flat(params):
        assert x.sharding == targets[path], (path, x.sharding, targets[path])
    trainer.close()

    print(
        f"\n[{'scanned' if scan_layers else 'per layer'}] per-device peak during the load "
        f"{max(watch.peak.values())} B, its shards {max(final.values())} B (the whole "
        f"model {sum(sizes.values())} B); largest read {max(data_reads)} B of the largest "
        f"tensor's {max(sizes.values())} B; largest host shard buffer "
        f"{max(b for b, _ in watch.callback_buffers)} B; host peak {host_peak} B "
        f"(the largest param {largest_param} B)"
    )


def test_a_value_head_the_checkpoint_lacks_is_initialised_in_its_sharding(checkpoint, tmp_path):
    config = _config(checkpoint, str(tmp_path / "run"), scan_layers=True, value_head=True)
    programs = TrainerPrograms(config, build_mesh(config.trainer.mesh))
    params = hf.load_hf_sharded(config.model, programs.abstract_params, seed=config.seed)
    built = hf.load_model_for_config(config.model, seed=config.seed)
    for name in ("value_w", "value_b"):
        assert params[name].sharding == programs.param_shardings[name]
        want = nnx.to_pure_dict(nnx.state(built, nnx.Param))[name]
        np.testing.assert_array_equal(params[name], want)


def test_reads_are_cut_to_max_read_bytes(checkpoint, tmp_path, monkeypatch):
    config = _config(checkpoint, str(tmp_path / "run"), scan_layers=False)
    programs = TrainerPrograms(config, build_mesh(config.trainer.mesh))
    reads = []
    read_range = storage.read_range
    monkeypatch.setattr(
        storage, "read_range", lambda url, s, n: reads.append((s, n)) or read_range(url, s, n)
    )
    params = hf.load_hf_sharded(config.model, programs.abstract_params, max_read_bytes=1000)
    monkeypatch.undo()
    jax.tree.map(np.testing.assert_array_equal, params, hf.load_hf_params(checkpoint, config.model))
    start = _data_start(checkpoint)
    # Reads are cut at whole rows of the HF tensor's view (q/k/v's: one head, [head_dim, hidden]).
    row = config.model.head_dim * config.model.hidden_size * 4
    assert max(n for s, n in reads if s >= start) <= max(1000, row)


def test_a_misshapen_tensor_is_refused_naming_it(checkpoint, tmp_path):
    tensors = safetensors.numpy.load_file(os.path.join(checkpoint, "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(Path(checkpoint, "config.json").read_text())
    safetensors.numpy.save_file(tensors, str(bad / "model.safetensors"))
    config = _config(str(bad), str(tmp_path / "run"), scan_layers=False)
    programs = TrainerPrograms(config, build_mesh(config.trainer.mesh))
    with pytest.raises(CheckpointMismatchError, match=f"{name}.*has shape"):
        hf.load_hf_sharded(config.model, programs.abstract_params)


def test_a_gcs_checkpoint_loads_the_same(checkpoint, gcs_bucket, tmp_path):
    remote = f"{gcs_bucket}/qwen2"
    storage.copy_tree(checkpoint, remote)
    config = _config(remote, str(tmp_path / "run"), scan_layers=True)
    programs = TrainerPrograms(config, build_mesh(config.trainer.mesh))
    params = hf.load_hf_sharded(config.model, programs.abstract_params)
    local = dataclasses.replace(config.model, hf_checkpoint=checkpoint)
    jax.tree.map(
        np.testing.assert_array_equal,
        params,
        hf.load_hf_sharded(local, programs.abstract_params),
    )


def test_an_engine_given_host_weights_puts_on_each_device_only_its_slice(checkpoint, monkeypatch):
    """`rlax-tpu eval` hands the inference engine host weights (load_hf_params): on a
    tensor-parallel mesh each device receives its slice, never the whole array."""
    model = hf.load_hf_config(checkpoint, param_dtype="float32", dtype="float32")
    inference = InferenceConfig(
        mesh=MeshConfig(data=1, fsdp=1, tensor=2),
        max_decode_slots=4,
        page_size=8,
        kv_cache_bytes=2**20,
        prefill_buckets=(16,),
        max_prompt_len=16,
        max_new_tokens=8,
        attention_backend="jax",
    )
    mesh = build_mesh(inference.mesh, devices=jax.devices()[:2])
    engine = Engine(model, inference, seed=0, mesh=mesh)
    leaves = engine.abstract_params()
    params = hf.load_hf_params(checkpoint, model)
    watch = LoadWatch(monkeypatch, {x.shape for x in leaves if not x.sharding.is_fully_replicated})
    try:
        engine.load(0, params)
    finally:
        watch.close()
        monkeypatch.undo()
    assert not watch.whole_on_one_device, sorted(set(watch.whole_on_one_device))
    shards: collections.Counter = collections.Counter()
    for x in leaves:
        for device in x.sharding.device_set:
            shards[device] += _shard_bytes(x)
    assert all(watch.peak[d] <= shards[d] for d in shards), (watch.peak, shards)


# -- two processes ------------------------------------------------------------------------------

# One process of the two: loads the checkpoint through Trainer.initialize() and reports the
# data bytes it read and whether each of its shards equals that slice of the host reference.
_WORKER = textwrap.dedent(
    """
    import ctypes, json, signal, sys
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the test
    from rlax_tpu.distributed import initialize_from_environment

    initialize_from_environment()
    import jax
    import numpy as np
    from rlax_tpu import storage
    from rlax_tpu.config import RunConfig
    from rlax_tpu.models import hf
    from rlax_tpu.trainer import Trainer

    config_json, data_start, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = RunConfig.from_dict(json.loads(config_json))
    reads = []
    read_range = storage.read_range
    storage.read_range = lambda url, s, n: reads.append((s, n)) or read_range(url, s, n)
    trainer = Trainer(config)
    trainer.initialize()
    storage.read_range = read_range
    reference = hf.load_hf_params(config.model.hf_checkpoint, config.model)
    equal = True
    for x, want in zip(
        jax.tree.leaves(trainer.params()), jax.tree.leaves(reference), strict=True
    ):
        for shard in x.addressable_shards:
            equal &= np.array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])
    report = {
        "bytes_read": sum(n for s, n in reads if s >= data_start),
        "shards_equal": bool(equal),
        "spans": sorted({d.process_index for d in trainer.mesh.devices.flat}),
    }
    trainer.close()
    with open(out, "w") as f:
        json.dump(report, f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_of_two_processes_reads_only_its_devices_rows(checkpoint, tmp_path):
    """Two processes of 4 CPU devices form the 8-device mesh; fsdp spans them, so each
    holds half of every embed-sharded parameter and reads only the HF rows of its half."""
    config = _config(checkpoint, str(tmp_path / "run"), scan_layers=True)
    config_json = json.dumps(config.to_dict())
    coordinator = f"127.0.0.1:{_free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RLAX_TPU_")}
    workers, outs = [], []
    for p in range(2):
        out = tmp_path / f"process-{p}.json"
        env = {
            **base,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "RLAX_TPU_COORDINATOR_ADDRESS": coordinator,
            "RLAX_TPU_NUM_PROCESSES": "2",
            "RLAX_TPU_PROCESS_ID": str(p),
            "RLAX_TPU_INITIALIZATION_TIMEOUT_S": "60",
        }
        args = [config_json, str(_data_start(checkpoint)), str(out)]
        log = open(tmp_path / f"process-{p}.log", "wb")  # noqa: SIM115 - closed below
        workers.append(
            (
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER, *args], env=env, stdout=log, stderr=log
                ),
                log,
            )
        )
        outs.append(out)
    try:
        codes = [w.wait(timeout=180) for w, _ in workers]
    finally:
        for w, log in workers:  # only the processes this test started
            if w.poll() is None:
                w.kill()
                w.wait()
            log.close()
    logs = "\n".join((tmp_path / f"process-{p}.log").read_text()[-3000:] for p in range(2))
    assert codes == [0, 0], logs
    reports = [json.loads(out.read_text()) for out in outs]
    # o_proj [hidden, heads*head_dim] and down_proj [hidden, mlp] have the fsdp-sharded
    # hidden dimension as their HF rows: each process reads half of those, all of the rest.
    sizes = _tensor_bytes(checkpoint)
    halved = sum(
        n for name, n in sizes.items() if name.endswith(("o_proj.weight", "down_proj.weight"))
    )
    for report in reports:
        assert report["spans"] == [0, 1]
        assert report["shards_equal"], report
        assert report["bytes_read"] == sum(sizes.values()) - halved // 2, report
