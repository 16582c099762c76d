"""The parameter-server client against real server processes: pytrees in and out, shardings,
idempotent publishes, replicas split along the tensor-parallel dimension, retention."""

import concurrent.futures
import secrets
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding
from processes import ProcessGroup

from rlax_tpu.api import tensors as layout
from rlax_tpu.api.param_server import (
    ParamServerCallError,
    ReplicaPlan,
    VersionsMissingError,
    split_dims_from_logical,
)
from rlax_tpu.config import DEFAULT_LOGICAL_AXIS_RULES, MeshConfig, ModelConfig
from rlax_tpu.models import Transformer
from rlax_tpu.models.transformer import param_logical_axes
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.sharding import build_mesh, shard_model, state_shardings
from rlax_tpu.tree import flatten

TOKEN = secrets.token_hex(8)
MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.fixture
def servers():
    group = ProcessGroup()
    yield lambda n=1, storage=None: [
        group.start_param_server(storage, token=TOKEN).address for _ in range(n)
    ]
    group.stop_all()


def _params(seed=0):
    return nnx.to_pure_dict(nnx.state(Transformer(MODEL, rngs=nnx.Rngs(seed)), nnx.Param))


def _logical_axes():
    return param_logical_axes(MODEL)


def test_sharded_publish_then_pull_into_another_sharding(servers):
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    trainer_mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shard_model(model, trainer_mesh, DEFAULT_LOGICAL_AXIS_RULES)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    (address,) = servers()
    with TreeClient([address], auth_token=TOKEN) as client:
        client.publish(0, params)
        worker_mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=-1))
        shardings = nnx.to_pure_dict(
            state_shardings(nnx.state(model, nnx.Param), worker_mesh, DEFAULT_LOGICAL_AXIS_RULES)
        )
        like = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
        )
        pulled = client.pull(0, like)
    for path, value in flatten(pulled).items():
        original = flatten(params)[path]
        np.testing.assert_array_equal(np.asarray(value), np.asarray(original), err_msg=path)
        assert value.sharding == flatten(shardings)[path], path


def test_pull_onto_one_device(servers):
    params = _params()
    (address,) = servers()
    with TreeClient([address], auth_token=TOKEN) as client:
        client.publish(0, params)
        device = jax.devices()[3]
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)),
            params,
        )
        pulled = client.pull(0, like)
    leaf = pulled["layers"][1]["mlp"]["w_up"]
    assert leaf.devices() == {device}
    np.testing.assert_array_equal(leaf, params["layers"][1]["mlp"]["w_up"])


def test_a_waiting_pull_gets_the_version_as_it_commits(servers):
    """pull(wait_s=…) asked before the publish returns the version once it commits; a pull
    without waiting, or whose wait runs out, is NOT_FOUND."""
    params, later = _params(0), _params(1)
    (address,) = servers()
    device = SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params)
    with TreeClient([address], auth_token=TOKEN) as client:
        client.publish(0, params)  # the layout the pull needs
        with pytest.raises(ParamServerCallError) as info:
            client.pull(1, like)
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        t0 = time.monotonic()
        with pytest.raises(ParamServerCallError) as info:
            client.pull(1, like, wait_s=0.3)
        assert info.value.code == grpc.StatusCode.NOT_FOUND and time.monotonic() - t0 >= 0.3
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.pull, 1, like, wait_s=60)
            time.sleep(0.5)
            assert not waiting.done()
            client.publish(1, later)
            pulled = waiting.result(timeout=30)
    for a, b in zip(jax.tree.leaves(pulled), jax.tree.leaves(later), strict=True):
        np.testing.assert_array_equal(a, b)


def test_republish_is_a_no_op_and_different_content_is_refused(servers):
    (address,) = servers()
    with TreeClient([address], auth_token=TOKEN) as client:
        first = client.publish(0, _params(0))
        assert not first.already_present
        assert client.publish(0, _params(0)).already_present
        with pytest.raises(ParamServerCallError) as info:
            client.publish(0, _params(1))
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        np.testing.assert_array_equal(client.pull_arrays(0)["embed"], _params(0)["embed"])


def test_replicas_split_along_the_tensor_dimension(servers):
    params = _params()
    split = split_dims_from_logical(_logical_axes(), DEFAULT_LOGICAL_AXIS_RULES)
    assert split["layers/0/attn/wq"] == 1 and split["layers/0/mlp/w_down"] == 0
    plan = ReplicaPlan(num_replicas=2, split_dims=split)
    addresses = servers(2)
    with TreeClient(addresses, auth_token=TOKEN, plan=plan) as client:
        client.publish(0, params)
        held = client.held_pieces()
        assert held[0]["layers/0/attn/wq"].domain == ((0, 32), (0, 2), (0, 8))
        assert held[1]["layers/0/attn/wq"].domain == ((0, 32), (2, 4), (0, 8))
        # Every array is held, whole or split, and nothing twice.
        total = sum(p.nbytes for h in held for p in h.values())
        assert total == sum(np.asarray(x).nbytes for x in flatten(params).values())

        # A tensor-parallel-2 worker's second shard comes from replica 1 only.
        box = ((0, 32), (2, 4), (0, 8))
        before = client.bytes_pulled
        got = client.pull_boxes(0, {"layers/0/attn/wq": [box]})
        assert client.bytes_pulled - before == 32 * 2 * 8 * 4
        wq = np.asarray(params["layers"][0]["attn"]["wq"])
        np.testing.assert_array_equal(got[("layers/0/attn/wq", box)], wq[:, 2:4, :])

        # A box spanning both replicas is assembled from both.
        whole = client.pull_arrays(0)
        for path, value in flatten(params).items():
            np.testing.assert_array_equal(whole[path], np.asarray(value), err_msg=path)


def test_retention_through_the_client(servers, tmp_path):
    (address,) = servers(storage=str(tmp_path / "params"))
    tree = {"w": np.arange(6, dtype=np.float32)}
    with TreeClient([address], auth_token=TOKEN) as client:
        for version in range(4):
            client.publish(version, {"w": tree["w"] + version})
        client.confirm("worker-0", 1)  # worker-0 still needs version 1
        assert client.garbage_collect(3) == [0]
        assert client.versions() == [1, 2, 3]
        client.confirm("worker-0", 3)
        assert client.garbage_collect(3) == [1, 2]
        with pytest.raises(ParamServerCallError) as info:
            client.pull_arrays(1)
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        assert "3" in str(info.value)
        np.testing.assert_array_equal(client.pull_arrays(3)["w"], tree["w"] + 3)


def test_wait_persisted_returns_once_versions_are_on_storage_and_names_what_is_not(
    servers, tmp_path
):
    (address,) = servers(storage=str(tmp_path / "params"))
    (memory_only,) = servers()
    with TreeClient([address], auth_token=TOKEN) as client:
        for version in range(2):
            client.publish(version, {"w": np.arange(6, dtype=np.float32) + version})
        client.wait_persisted([0, 1], timeout_s=30)
        assert [v.persisted for v in client.list_versions().versions] == [True, True]
        assert (tmp_path / "params" / "versions" / "0000000001" / "MANIFEST.json").exists()
        with pytest.raises(VersionsMissingError, match=r"versions \[5\] are not held") as info:
            client.wait_persisted([1, 5], timeout_s=5)
        assert info.value.missing == [5] and info.value.code == grpc.StatusCode.NOT_FOUND
    with TreeClient([memory_only], auth_token=TOKEN) as client:
        client.publish(0, {"w": np.zeros(3, np.float32)})
        client.wait_persisted([0, 1])  # no storage: nothing to wait for


def test_bfloat16_round_trip_is_bit_exact(servers):
    tree = {
        "a": jnp.linspace(-3, 3, 96, dtype=jnp.bfloat16).reshape(8, 12),
        "b": np.arange(10, dtype=np.int32),
    }
    (address,) = servers()
    with TreeClient([address], auth_token=TOKEN) as client:
        client.publish(0, tree)
        out = client.pull_arrays(0)
    assert out["a"].dtype == jnp.bfloat16
    assert layout.to_bytes(out["a"]).tobytes() == layout.to_bytes(np.asarray(tree["a"])).tobytes()
    np.testing.assert_array_equal(out["b"], tree["b"])


def test_wrong_token_is_rejected_by_the_client(servers):
    (address,) = servers()
    with TreeClient([address], auth_token="wrong") as client:
        with pytest.raises(ParamServerCallError) as info:
            client.publish(0, {"w": np.zeros(3, np.float32)})
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with TreeClient([address], auth_token=TOKEN) as client:
        assert client.versions() == []


def test_repeated_pulls_are_identical_and_gc_ends_them(servers, tmp_path):
    (address,) = servers(storage=str(tmp_path / "params"))
    trees = [{"w": np.arange(12, dtype=np.float32).reshape(3, 4) * (v + 1)} for v in range(3)]
    with TreeClient([address], auth_token=TOKEN) as client:
        client.publish(0, trees[0])
        client.publish(1, trees[1])
        first = client.pull_arrays(1)["w"]
        second = client.pull_arrays(1)["w"]
        np.testing.assert_array_equal(first, trees[1]["w"])
        np.testing.assert_array_equal(second, trees[1]["w"])
        half = ((0, 3), (2, 4))
        got = client.pull_boxes(1, {"w": [half]})[("w", half)]
        np.testing.assert_array_equal(got, trees[1]["w"][:, 2:4])
        client.publish(2, trees[2])
        assert client.garbage_collect(2) == [0, 1]
        with pytest.raises(ParamServerCallError) as info:
            client.pull_arrays(1)
        assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_inference_server_builds_its_client_with_the_configured_chunk_bytes(monkeypatch):
    """`serve inference` passes param_server.chunk_bytes to its ParamServerClient."""
    from rlax_tpu.api import param_server as api_module
    from rlax_tpu.cli import build_parser
    from rlax_tpu.inference import server as inference_server
    from rlax_tpu.param_server import trees as client_module

    class Built(Exception):
        """Stops the server right after it made its client."""

    made = {}

    def make_client(addresses, **kwargs):
        made.update(kwargs, addresses=list(addresses))
        raise Built

    monkeypatch.setattr(client_module, "TreeClient", make_client)
    monkeypatch.setenv("RLAX_TPU_AUTH_TOKEN", TOKEN)
    chunk_bytes = 64 * 2**10
    assert chunk_bytes != api_module.DEFAULT_CHUNK_BYTES
    args = build_parser().parse_args(
        [
            "serve",
            "inference",
            "--set",
            f"param_server.chunk_bytes={chunk_bytes}",
            "--param-server",
            "127.0.0.1:1",
        ]
    )
    with pytest.raises(Built):
        inference_server.main(args)
    assert made["addresses"] == ["127.0.0.1:1"]
    assert made.get("chunk_bytes") == chunk_bytes
