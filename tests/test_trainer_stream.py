"""TrainStep and SftStep stream their batch in chunks below `trainer.max_message_bytes`. The
chunk codec on its own: any cut of the bytes reassembles exactly; a truncated, oversized,
misshapen or mistyped stream is refused naming the problem; the optional fields (dense
rewards, given advantages and returns, baselines) travel when present and enter the batch's
digest. A real trainer process with the limit lowered to 1 KiB: a batch several times the
limit trains, a client whose messages exceed the limit gets RESOURCE_EXHAUSTED naming the
knob, every refused stream leaves the trainer unchanged, a batch with the optional fields
trains and its repeat must bring the same ones. Slow: with a warm start, the SFT and train
batches streamed in 1 KiB messages train bit for bit as a second trainer trains them sent
whole."""

import grpc
import numpy as np
import pytest
from processes import ProcessGroup
from test_trainer_service import OVERRIDES, SEQ, TINY, TOKEN, call_error, rollout_batch

from rlax_tpu.api.trainer import (
    SFT_STEP,
    TRAIN_STEP,
    BatchFormatError,
    BatchLimits,
    BatchReceiver,
    TrainerClient,
    TruncatedStreamError,
    batch_digest,
    batch_stream,
    pack_batch,
    unpack_batch,
)
from rlax_tpu.config import load_config
from rlax_tpu.rpc import make_channel
from rlax_tpu.rpc.protos import trainer_pb2 as pb
from rlax_tpu.rpc.protos import trainer_pb2_grpc as pb_grpc
from rlax_tpu.trainer.service import batch_from_arrays

LIMIT = 1024  # bytes: the tiny config's train batch is ~2.6 KB, its SFT batch 2.3 KB
LIMITS = BatchLimits(max_rows=8, max_seq_len=SEQ, vocab_size=512)
_CONFIG = load_config(TINY, OVERRIDES)  # global batch 8, trainer.max_seq_len = SEQ


def arrays_of(batch) -> dict:
    return TRAIN_STEP.arrays_of(batch)


def sft_arrays(step: int, size: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    tokens = rng.integers(1, 512, (size, SEQ), dtype=np.int32)
    mask = np.zeros((size, SEQ), np.float32)
    mask[:, 8:] = 1.0
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "loss_mask": mask}


def receive(chunks, schema=TRAIN_STEP, limits=LIMITS):
    receiver = BatchReceiver(schema, limits)
    for chunk in chunks:
        receiver.add(chunk)
    return receiver.finish()


def with_header(chunks: list, **changes) -> list:
    """`chunks` with the header's tensor `name` declared as (dtype, shape) = changes[name]."""
    header = pb.BatchHeader()
    header.CopyFrom(chunks[0].header)
    for spec in header.tensors:
        if spec.name in changes:
            dtype, shape = changes[spec.name]
            spec.dtype = dtype or spec.dtype
            spec.shape[:] = shape or spec.shape
    return [pb.BatchChunk(header=header), *chunks[1:]]


def train_chunks(step: int = 1, **optional) -> list:
    """The messages of TrainStep `step` on the test batch (with `optional` fields), cut below
    LIMIT."""
    batch = {**arrays_of(rollout_batch(_CONFIG, step)), **optional}
    return list(batch_stream(step, batch, max_message_bytes=LIMIT))


def optional_fields(seed: int = 0, rows: int = 8) -> dict[str, np.ndarray]:
    """Dense rewards, given advantages and returns ([rows, SEQ]) and baselines ([rows])."""
    rng = np.random.default_rng(seed)
    per_token = {
        name: rng.standard_normal((rows, SEQ)).astype(np.float32)
        for name in ("token_rewards", "token_advantages", "returns")
    }
    return {**per_token, "baseline_rewards": rng.standard_normal(rows).astype(np.float32)}


# -- the codec ----------------------------------------------------------------------------------
def test_every_message_fits_the_limit_and_the_batch_reassembles_exactly():
    batch = rollout_batch(_CONFIG, 3).replace(values=np.ones((8, SEQ), np.float32))
    chunks = list(batch_stream(3, arrays_of(batch), max_message_bytes=LIMIT))
    assert max(c.ByteSize() for c in chunks) <= LIMIT
    sent = sum(a.nbytes for a in arrays_of(batch).values() if a is not None)
    assert sent > 2 * LIMIT and sum(c.HasField("data") for c in chunks) >= sent // LIMIT + 1
    step, got = receive(chunks)
    assert step == 3
    for name, array in arrays_of(batch).items():
        if array is None:
            assert got[name] is None, name
        else:
            assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name


def test_data_cut_anywhere_reassembles_and_other_dtypes_are_cast():
    """Chunks may span arrays (the receiver reads one byte stream); int64 tokens and float16
    masks arrive as int32 and float32."""
    arrays = sft_arrays(0)
    arrays["tokens"] = arrays["tokens"].astype(np.int64)
    arrays["loss_mask"] = arrays["loss_mask"].astype(np.float16)
    header, *data = pack_batch(4, arrays)[1:]
    joined = b"".join(bytes(d) for d in data)
    receiver = BatchReceiver(SFT_STEP, LIMITS)
    receiver.header(pb.BatchHeader.FromString(header))
    for start in range(0, len(joined), 333):  # 333 does not divide any array's size
        receiver.data(joined[start : start + 333])
    receiver.end()
    step, got = receiver.finish()
    assert step == 4
    assert got["tokens"].dtype == np.int32 and np.array_equal(got["tokens"], arrays["tokens"])
    assert got["loss_mask"].dtype == np.float32
    assert np.array_equal(got["loss_mask"], arrays["loss_mask"].astype(np.float32))
    again = unpack_batch(b"".join(pack_batch(4, arrays)), SFT_STEP, LIMITS)
    assert again[0] == 4 and np.array_equal(again[1]["targets"], arrays["targets"])


def test_the_optional_fields_reassemble_exactly_and_absent_ones_arrive_as_none():
    optional = optional_fields()
    for present in (list(optional), ["token_rewards"], ["baseline_rewards"], []):
        sent = {name: optional[name] for name in present}
        step, got = receive(train_chunks(3, **sent))
        assert step == 3
        for name in optional:
            if name in sent:
                assert got[name].dtype == np.float32
                np.testing.assert_array_equal(got[name], sent[name])
            else:
                assert got[name] is None, name
        batch = batch_from_arrays(got)
        assert batch_digest(batch) == batch_digest(batch_from_arrays({**got, **sent}))
    # Other float dtypes are cast, like every float field.
    _, got = receive(train_chunks(3, returns=optional["returns"].astype(np.float64)))
    assert got["returns"].dtype == np.float32


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("token_rewards", np.zeros((8, SEQ - 1), np.float32), r"token_rewards has length 31, "),
        ("token_advantages", np.zeros((7, SEQ), np.float32), r"token_advantages has 7 sequen"),
        ("returns", np.zeros((8,), np.float32), r"returns must have shape \[batch, seq\], got"),
        ("baseline_rewards", np.zeros((8, SEQ), np.float32), r"baseline_rewards must have shape "),
        ("baseline_rewards", np.zeros((8,), np.int32), r"baseline_rewards must be a floating"),
    ],
    ids=["length", "rows", "rank-1", "rank-2", "dtype"],
)
def test_a_misshapen_optional_field_is_refused_naming_it(field, value, error):
    receiver = BatchReceiver(TRAIN_STEP, LIMITS)
    with pytest.raises(BatchFormatError, match=r"batch\." + error) as info:
        for chunk in train_chunks(1, **{field: value}):
            receiver.add(chunk)
    assert info.value.field == f"batch.{field}"


@pytest.mark.parametrize(
    "field", ["token_rewards", "token_advantages", "returns", "baseline_rewards"]
)
def test_a_value_that_is_not_finite_is_refused_naming_its_field(field):
    value = optional_fields()[field]
    value.reshape(-1)[3] = np.nan
    _, arrays = receive(train_chunks(1, **{field: value}))
    with pytest.raises(BatchFormatError, match=f"batch.{field} holds a value that is not finite"):
        batch_from_arrays(arrays)


def test_the_digest_covers_each_optional_field_present_and_no_other():
    batch = rollout_batch(_CONFIG, 0)
    # The digest of this batch before the optional fields existed: runs with a recorded
    # result keep answering their repeats.
    assert batch_digest(batch) == "6d29f0f48dfba3e49bcd5182e8222216"
    optional = optional_fields()
    digests = {batch_digest(batch)}
    for name, value in optional.items():
        with_field = batch.replace(**{name: value})
        assert batch_digest(with_field) == batch_digest(batch.replace(**{name: value.copy()}))
        changed = value.copy()
        changed.reshape(-1)[0] += 1.0
        assert batch_digest(batch.replace(**{name: changed})) != batch_digest(with_field)
        digests.add(batch_digest(with_field))
    # All zeros is present, not absent; the same values under another field differ.
    zeros = np.zeros((8, SEQ), np.float32)
    digests |= {batch_digest(batch.replace(token_rewards=zeros))}
    digests |= {batch_digest(batch.replace(returns=zeros))}
    assert len(digests) == 1 + len(optional) + 2
    # What the trainer computes itself is not digested.
    assert batch_digest(batch.replace(rollout_logprobs=zeros)) == batch_digest(batch)


def test_a_stream_without_its_end_is_truncated():
    with pytest.raises(TruncatedStreamError, match="stopped without its end message"):
        receive(train_chunks()[:-1])
    with pytest.raises(TruncatedStreamError, match="ended without a header"):
        receive([])


def test_a_stream_missing_chunks_is_truncated_naming_the_incomplete_field():
    chunks = train_chunks()
    missing = [c for i, c in enumerate(chunks) if i != len(chunks) - 2]  # the last data chunk
    with pytest.raises(TruncatedStreamError, match=r"batch\.versions is incomplete.*send the"):
        receive(missing)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"tokens": (None, [16, SEQ])}, r"batch\.tokens declares 16 sequences, more than the "),
        ({"tokens": (None, [8, 64])}, r"batch\.tokens declares length 64, over trainer\.max_"),
        ({"rewards": (None, [8, 1])}, r"batch\.rewards must have shape \[batch\], got \[8, 1\]"),
        ({"group_ids": (None, [7])}, r"batch\.group_ids has 7 sequences, batch\.tokens has 8"),
        ({"tokens": ("float32", None)}, r"batch\.tokens must be an integer array, got float32"),
        ({"rewards": ("int32", None)}, r"batch\.rewards must be a floating-point array"),
        ({"versions": ("object", None)}, r"batch\.versions has non-numeric dtype"),
        ({"tokens": (None, [8, -1])}, r"batch\.tokens has a negative dimension in shape"),
    ],
    ids=["rows", "length", "rank", "batch-size", "int-dtype", "float-dtype", "object", "negative"],
)
def test_a_header_over_the_limits_or_of_the_wrong_shape_or_dtype_is_refused(changes, error):
    """Refused at the header, before any data is read or memory allocated."""
    receiver = BatchReceiver(TRAIN_STEP, LIMITS)
    with pytest.raises(BatchFormatError, match=error):
        receiver.add(with_header(train_chunks(), **changes)[0])
    assert receiver.declared_bytes == 0


def test_out_of_order_surplus_unknown_or_repeated_messages_are_refused():
    chunks = train_chunks()
    specs = list(chunks[0].header.tensors)
    cases = {
        "sent data before its header": [chunks[1]],
        "sent end before its header": [chunks[-1]],
        "has an empty message": [pb.BatchChunk()],
        "has a second header": [chunks[0], chunks[0]],
        "carries more data than its header declares": [*chunks[:-1], chunks[1]],
        "has a message after its end": [*chunks, chunks[1]],
        r"batch\.response_mask is missing": [
            pb.BatchChunk(header=pb.BatchHeader(step=1, tensors=chunks[0].header.tensors[:1]))
        ],
        r"step must be >= 0": [pb.BatchChunk(header=pb.BatchHeader(step=-1))],
        r"batch\.logits is not a TrainStep field": [
            pb.BatchChunk(
                header=pb.BatchHeader(step=1, tensors=[*specs, pb.TensorSpec(name="logits")])
            )
        ],
        r"batch\.tokens is declared twice": [
            pb.BatchChunk(header=pb.BatchHeader(step=1, tensors=[*specs, specs[0]]))
        ],
    }
    for message, stream in cases.items():
        with pytest.raises(BatchFormatError, match=message):
            receive(stream)


def test_a_call_cut_off_by_the_client_is_a_truncated_stream():
    """gRPC's request iterator raises when the client cancels or its deadline passes."""
    from rlax_tpu.trainer.service import receive as service_receive

    def cut_off():
        yield from train_chunks()[:2]
        raise grpc.RpcError()

    with pytest.raises(TruncatedStreamError, match=r"cut off after \d+ of \d+ bytes \(the client"):
        service_receive(cut_off(), TRAIN_STEP, LIMITS)


# -- a real trainer process with the limit lowered -----------------------------------------------
@pytest.fixture(scope="module")
def group():
    group = ProcessGroup()
    yield group
    group.stop_all()


def start_trainer(group, run_dir, limit: int | None, *overrides: str):
    """`serve trainer` without a parameter server; messages of at most `limit` bytes."""
    extra = [] if limit is None else [f"trainer.max_message_bytes={limit}"]
    return group.start_trainer(
        TINY, token=TOKEN, overrides=[*OVERRIDES, f"storage.run_dir={run_dir}", *extra, *overrides]
    )


@pytest.fixture(scope="module")
def chunked(group, tmp_path_factory):
    """A trainer that accepts messages of at most LIMIT bytes (no warm start)."""
    return start_trainer(group, tmp_path_factory.mktemp("chunked"), LIMIT)


@pytest.fixture(scope="module")
def client(chunked):
    with TrainerClient(
        chunked.address, auth_token=TOKEN, timeout_s=300, max_message_bytes=LIMIT
    ) as client:
        yield client


@pytest.fixture(scope="module")
def stub(chunked):
    """The Trainer stub on an authenticated channel, to send hand-made streams."""
    channel = make_channel(chunked.address, auth_token=TOKEN)
    yield pb_grpc.TrainerStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def first_step(client):
    """Step 0, streamed in chunks of at most LIMIT bytes."""
    return client.train_step(0, rollout_batch(_CONFIG, 0))


def rpc_error(call, chunks) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(iter(chunks), timeout=60)
    return info.value


def test_a_batch_several_times_the_limit_trains_through_the_server(first_step):
    batch = arrays_of(rollout_batch(_CONFIG, 0))
    assert sum(a.nbytes for a in batch.values() if a is not None) > 2 * LIMIT
    assert (first_step.step, first_step.version, first_step.already_done) == (0, 1, False)
    assert np.isfinite(first_step.metrics["loss"]) and first_step.metrics["grad_norm"] > 0
    assert first_step.metrics["time/receive_batch_s"] >= 0


def test_a_client_over_the_trainers_limit_is_resource_exhausted_naming_the_knob(
    first_step, chunked
):
    """The limit is the server's: a client with the default limit (1 MiB) sends each array
    of this batch in one message, over 1 KiB, and is refused."""
    with TrainerClient(chunked.address, auth_token=TOKEN, timeout_s=60) as big:
        error = call_error(big.train_step, 1, rollout_batch(_CONFIG, 1))
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "trainer.max_message_bytes" in str(error)
        assert big.status().version == 1


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no-end", "stopped without its end message"),
        ("missing-chunk", "batch.versions is incomplete"),
        ("rows", "batch.tokens declares 16 sequences, more than the global batch of 8"),
        ("length", "batch.tokens declares length 64, over trainer.max_seq_len (32)"),
        ("shape", "batch.rewards must have shape [batch], got [8, 1]"),
        ("dtype", "batch.tokens must be an integer array, got float32"),
    ],
)
def test_a_bad_stream_is_invalid_argument_and_changes_nothing(
    first_step, client, stub, case, expected
):
    chunks = train_chunks(1)
    stream = {
        "no-end": chunks[:-1],
        "missing-chunk": [c for i, c in enumerate(chunks) if i != len(chunks) - 2],
        "rows": with_header(chunks, tokens=(None, [16, SEQ])),
        "length": with_header(chunks, tokens=(None, [8, 64])),
        "shape": with_header(chunks, rewards=(None, [8, 1])),
        "dtype": with_header(chunks, tokens=("float32", None)),
    }[case]
    error = rpc_error(stub.TrainStep, stream)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details()
    assert client.status().version == 1


def test_an_sft_stream_reaches_the_trainer_whole_or_is_refused_truncated(first_step, client, stub):
    """This trainer has no warm start: a whole SftStep stream gets the trainer's own answer
    (FAILED_PRECONDITION), a truncated one is refused before the trainer sees it."""
    chunks = list(batch_stream(0, sft_arrays(0), max_message_bytes=LIMIT))
    error = rpc_error(stub.SftStep, chunks[:-2])  # the last data chunk and the end are lost
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stopped without its end message" in error.details()
    assert "(loss_mask is incomplete)" in error.details()
    error = call_error(client.sft_step, 0, *sft_arrays(0).values())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "trainer.warm_start.steps = 0" in str(error)
    assert client.status().version == 1


def test_after_refused_streams_the_next_step_trains_and_a_done_step_is_answered(first_step, client):
    again = client.train_step(0, rollout_batch(_CONFIG, 0))
    assert again.already_done and again.metrics == first_step.metrics
    second = client.train_step(1, rollout_batch(_CONFIG, 1))
    assert (second.step, second.version, second.already_done) == (1, 2, False)
    assert client.status().version == 2


def test_optional_fields_train_through_the_server_and_a_repeat_must_bring_the_same(
    first_step, client
):
    """A batch with every optional field, streamed in 1 KiB messages, trains; repeated with
    the same fields it is answered from its record, with other token rewards (or without
    them) it is refused as another batch; a misshapen one is refused naming the field."""
    step = client.status().version  # 1, or 2 after the test above
    batch = rollout_batch(_CONFIG, step).replace(**optional_fields(step))
    bad = batch.replace(token_rewards=np.zeros((8, SEQ - 1), np.float32))
    error = call_error(client.train_step, step, bad)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch.token_rewards has length 31" in str(error)
    result = client.train_step(step, batch)
    assert (result.step, result.already_done) == (step, False)
    assert np.isfinite(result.metrics["loss"])
    again = client.train_step(step, rollout_batch(_CONFIG, step).replace(**optional_fields(step)))
    assert again.already_done and again.metrics == result.metrics
    other = optional_fields(step)["token_rewards"]
    other[0, SEQ // 2] += 1.0
    for changed in (batch.replace(token_rewards=other), batch.replace(token_rewards=None)):
        error = call_error(client.train_step, step, changed)
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "repeated with another batch" in str(error)
    assert client.status().version == step + 1


@pytest.mark.slow
def test_sft_and_train_batches_over_the_limit_train_exactly_as_sent_whole(group, tmp_path):
    """With a warm start (trainer.warm_start.steps = 1): a trainer with the limit lowered and one
    with the default (every array in one message) train the same SFT step and train step to
    the same metrics, bit for bit; a truncated SftStep changes nothing first."""
    results = {}
    for limit in (LIMIT, None):
        process = start_trainer(group, tmp_path / str(limit), limit, "trainer.warm_start.steps=1")
        with TrainerClient(
            process.address, auth_token=TOKEN, timeout_s=300, max_message_bytes=limit
        ) as trainer:
            if limit is not None:
                channel = make_channel(process.address, auth_token=TOKEN)
                chunks = list(batch_stream(0, sft_arrays(0), max_message_bytes=limit))
                error = rpc_error(pb_grpc.TrainerStub(channel).SftStep, chunks[:-1])
                channel.close()
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert trainer.warm_start_step() == 0
            sft = trainer.sft_step(0, **sft_arrays(0))
            assert (sft.version, trainer.warm_start_step()) == (0, 1)
            results[limit] = (sft, trainer.train_step(0, rollout_batch(_CONFIG, 0)))
        assert process.stop() == 0
    for got, want in zip(results[LIMIT], results[None], strict=True):
        assert got.version == want.version
        assert untimed(got.metrics) == untimed(want.metrics)


def untimed(metrics: dict) -> dict:
    """`metrics` without the ones that measure time (step time, tokens/s, MFU)."""
    timed = ("tokens_per_s", "mfu")
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k not in timed}
