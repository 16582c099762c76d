"""The continuous-batching engine: greedy output equal to full recompute, batch invariance of
sampled rollouts, finish reasons, waiting for pages, reloads by version, and accounting."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu.config import ConfigError, InferenceConfig, MeshConfig, ModelConfig
from rlax_tpu.inference.engine import Engine, EngineNotLoadedError, GenerationRequest
from rlax_tpu.inference.sampling import SamplingParams
from rlax_tpu.inference.weights import ParamsMismatchError
from rlax_tpu.models import Transformer
from rlax_tpu.sharding import build_mesh

LLAMA = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, head_dim=8)
QWEN3 = dataclasses.replace(
    LLAMA, architecture="Qwen3ForCausalLM", qk_norm=True, tie_word_embeddings=True
)
# Keys + values of every layer for one page of 4 tokens, float32.
BYTES_PER_PAGE = 2 * LLAMA.num_layers * LLAMA.num_kv_heads * 4 * LLAMA.head_dim * 4
INFERENCE = InferenceConfig(
    max_decode_slots=4,
    prefill_batch_size=4,  # batched prefill (the default is 1 prompt per call)
    page_size=4,
    # A small pool (26 pages + padding): two full-length sequences fit, so requests also
    # wait for pages, not only for slots, in every test.
    kv_cache_bytes=27 * BYTES_PER_PAGE,
    prefill_buckets=(8, 16, 32),
    max_prompt_len=32,
    max_new_tokens=12,
    temperature=1.0,
    top_p=0.9,
    top_k=20,
)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    model = Transformer(config, rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def make_engine(config=LLAMA, inference=INFERENCE, *, params=None, seed=0, **kwargs) -> Engine:
    engine = Engine(config, inference, seed=seed, **kwargs)
    engine.load(0, init_params(config) if params is None else params)
    return engine


def prompt(length: int, seed: int, vocab: int = LLAMA.vocab_size) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, vocab, length))


def request(i: int, length: int, sampling=None, sample_index=0) -> GenerationRequest:
    return GenerationRequest(f"r{i}", f"p{i}", sample_index, prompt(length, i), sampling)


def reference_greedy(config, params, prompts, num_new):
    """Argmax of forward_train logits over each growing sequence (no cache).

    Returns (tokens int[batch, num_new], logprobs float[batch, num_new])."""
    model = Transformer(config, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    lengths = np.array([len(p) for p in prompts])
    seqs = np.zeros((len(prompts), lengths.max() + num_new), np.int32)
    for b, p in enumerate(prompts):
        seqs[b, : len(p)] = p
    logits_fn = jax.jit(lambda m, t: m.forward_train(t, t, return_logits=True).logits)
    tokens, logprobs = [], []
    rows = np.arange(len(prompts))
    for n in range(num_new):
        # Causal attention: padding after a sequence's end cannot change its logits.
        logits = np.asarray(logits_fn(model, jnp.asarray(seqs)))[rows, lengths - 1 + n]
        token = logits.argmax(-1)
        logprobs.append(np.asarray(jax.nn.log_softmax(logits, axis=-1))[rows, token])
        tokens.append(token)
        seqs[rows, lengths + n] = token
    return np.stack(tokens, 1), np.stack(logprobs, 1)


@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_greedy_generation_equals_full_recompute(config):
    # Seed 4: every greedy choice wins by > 5e-4 in logit, far above cache-vs-recompute rounding.
    params = init_params(config, seed=4)
    engine = make_engine(config, params=params)
    lengths = [1, 2, 5, 8, 9, 15, 16, 17, 24, 31, 32]
    prompts = [prompt(n, seed=n, vocab=config.vocab_size) for n in lengths]
    requests = [
        GenerationRequest(f"r{n}", f"p{n}", 0, p, GREEDY)
        for n, p in zip(lengths, prompts, strict=True)
    ]
    rollouts = engine.run(requests)
    want_tokens, want_logprobs = reference_greedy(config, params, prompts, GREEDY.max_new_tokens)
    for b, rollout in enumerate(rollouts):
        assert rollout.finish_reason == "length"
        assert rollout.tokens == tuple(want_tokens[b].tolist()), f"prompt length {lengths[b]}"
        np.testing.assert_allclose(rollout.logprobs, want_logprobs[b], atol=1e-5)


def test_sampled_rollout_is_identical_alone_mixed_and_across_runs():
    target = request(0, 13)
    others = [request(i, n) for i, n in enumerate([3, 30, 7, 21, 1, 16, 9], start=1)]
    mixed = others[:5] + [target] + others[5:]  # 8 requests for 4 slots: slots get refilled
    alone = make_engine().run([target])[0]
    engine = make_engine()
    first = engine.run(mixed)
    second = make_engine().run(list(reversed(mixed)))
    assert first[5] == alone == second[2]
    assert alone.finish_reason == "length" and len(alone.tokens) == INFERENCE.max_new_tokens
    # The other requests are different samples (the keys really differ per request).
    assert len({r.tokens for r in first}) == len(mixed)


def test_rollout_does_not_depend_on_the_sampling_params_of_its_neighbours():
    # The sampler sorts only when some row truncates: a row that does not truncate must come
    # out the same whether or not a neighbour made the sort run, and vice versa.
    plain = SamplingParams(temperature=1.0, max_new_tokens=10)
    truncating = SamplingParams(temperature=0.8, top_k=5, top_p=0.7, max_new_tokens=10)
    targets = [request(0, 11, plain), request(1, 6, truncating)]
    neighbours = [
        request(2, 20, truncating),
        request(3, 3, GREEDY),
        request(4, 9, dataclasses.replace(truncating, logprobs_of="sampled")),
        request(5, 25, plain),
    ]
    alone = [make_engine().run([t])[0] for t in targets]
    mixed = make_engine().run(neighbours[:2] + [targets[0]] + neighbours[2:] + [targets[1]])
    assert [mixed[2], mixed[5]] == alone


def test_multi_step_decode_calls_keep_every_rollout_and_batch_invariance():
    mixed = [request(i, n) for i, n in enumerate([3, 30, 7, 21, 1, 16, 9, 13])]
    engine = make_engine(decode_steps_per_call=4)
    together = engine.run(mixed)
    alone = make_engine(decode_steps_per_call=4).run([mixed[3]])[0]
    assert together[3] == alone
    assert [len(r.tokens) for r in together] == [INFERENCE.max_new_tokens] * len(mixed)
    assert engine.stats()["compiled"].count("decode:4x4") == 1


def test_stop_token_and_max_new_tokens_set_the_finish_reason():
    engine = make_engine()
    free = engine.run([request(0, 10)])[0]
    stop = free.tokens[4]
    first = free.tokens.index(stop)
    stop_at = dataclasses.replace(engine.defaults, stop_token_ids=(stop, 999))
    three = dataclasses.replace(engine.defaults, max_new_tokens=3)
    stopped, short = engine.run(
        [dataclasses.replace(request(0, 10, stop_at), request_id="a"), request(0, 10, three)]
    )
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == free.tokens[: first + 1]  # the stop token is included
    assert stopped.logprobs == free.logprobs[: first + 1]
    assert short.finish_reason == "length" and short.tokens == free.tokens[:3]


def test_sequence_ends_at_the_slots_maximum_length():
    engine = make_engine()
    long = dataclasses.replace(engine.defaults, max_new_tokens=1000)
    (rollout,) = engine.run([request(0, 30, long)])
    assert rollout.finish_reason == "length"
    assert len(rollout.prompt_tokens) + len(rollout.tokens) == engine.max_seq_len


def test_unrunnable_prompts_error_alone_while_others_complete():
    engine = make_engine()
    bad = [
        request(1, INFERENCE.max_prompt_len + 1),
        GenerationRequest("empty", "p", 0, ()),
        GenerationRequest("vocab", "p", 0, (1, LLAMA.vocab_size)),
    ]
    good = [request(i, n) for i, n in [(2, 5), (3, 32), (4, 9)]]
    rollouts = engine.run([good[0], bad[0], good[1], bad[1], bad[2], good[2]])
    reasons = [r.finish_reason for r in rollouts]
    assert reasons == ["length", "error", "length", "error", "error", "length"]
    assert "max_prompt_len" in rollouts[1].error and rollouts[1].tokens == ()
    assert "empty" in rollouts[3].error and "[0, 128)" in rollouts[4].error


RESERVE = dataclasses.replace(INFERENCE, kv_admission="reserve")


def test_out_of_pages_requests_wait_and_all_complete_identically():
    # Reserve admission: the shared pool holds 26 pages; a 32 + 12 token sequence takes 11.
    engine = make_engine(inference=RESERVE)
    assert engine.stats()["total_pages"] == 26
    requests = [request(i, n) for i, n in enumerate([32, 30, 28, 1, 9, 31])]
    for r in requests:
        engine.submit(r)
    engine.step()
    stats = engine.stats()
    assert stats["waiting"] == 4 and stats["active_slots"] == 2  # free slots, but no pages
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    for rollout, r in zip(
        sorted(finished, key=lambda r: int(r.request_id[1:])), requests, strict=True
    ):
        assert rollout.finish_reason == "length"
        assert rollout == engine.run([r])[0]  # as when it runs alone, with pages to spare
    too_small = dataclasses.replace(RESERVE, kv_cache_bytes=8 * BYTES_PER_PAGE)
    engine = Engine(LLAMA, too_small, seed=0)
    engine.load(0, init_params(LLAMA))
    engine.submit(request(9, 30))  # needs 11 pages of the 7 there are: can never run
    (rollout,) = engine.step()
    assert rollout.finish_reason == "error" and "pages" in rollout.error


def test_load_aborts_requests_in_flight_and_later_ones_carry_the_new_version():
    engine = make_engine()
    for i, n in enumerate([5, 9, 30, 2, 17, 3]):
        engine.submit(request(i, n))
    done = engine.step() + engine.step() + engine.step()
    assert engine.load(0, init_params(LLAMA, seed=5)) == []  # same version: a no-op
    assert engine.has_work()
    aborted = engine.load(1, init_params(LLAMA, seed=5))
    assert [r.request_id for r in aborted] == [f"r{i}" for i in range(6)]
    assert {r.finish_reason for r in aborted} == {"aborted"}
    assert {r.version for r in aborted} == {0}
    assert sum(len(r.tokens) for r in aborted) > 0  # some had started decoding
    assert not engine.has_work() and done == []
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["version"] == 1
    (later,) = engine.run([request(0, 5)])
    assert later.version == 1 and later.finish_reason == "length"


def test_slots_and_pages_are_all_freed_at_the_end():
    engine = make_engine()
    engine.run([request(i, n) for i, n in enumerate([1, 32, 8, 17, 4, 25, 11])])
    stats = engine.stats()
    assert stats["active_slots"] == 0 and stats["waiting"] == 0
    assert stats["free_pages"] == stats["total_pages"]
    paging = engine.paging_state()
    assert paging.used_pages == 0 and not paging.page_table.any()
    assert paging.in_flight == () and all(s is None for s in paging.slots)


def test_compiled_shapes_stay_one_per_bucket_plus_decode():
    engine = make_engine()
    engine.run([request(i, n) for i, n in enumerate([1, 3, 8, 9, 14, 16, 17, 32])])
    stats = engine.stats()
    assert stats["compiled"] == ["decode:4x1", "prefill:4x16", "prefill:4x32", "prefill:4x8"]
    engine.run([request(i, n) for i, n in enumerate([2, 12, 31], start=10)])
    engine.run([request(i, n) for i, n in enumerate([5] * 9 + [20] * 3, start=20)])
    assert engine.stats()["compiled_shapes"] == 4  # however many rows each call really held
    assert stats["tokens_generated"] == 8 * INFERENCE.max_new_tokens and stats["prefills"] == 8
    assert stats["prefill_calls"] < stats["prefills"]


# -- batched prefill -----------------------------------------------------------------------------
def one_per_call(inference=INFERENCE) -> InferenceConfig:
    return dataclasses.replace(inference, prefill_batch_size=1)


def test_prefill_batch_size_defaults_to_one_and_is_validated():
    assert InferenceConfig().prefill_rows == 1
    assert INFERENCE.prefill_rows == 4
    assert one_per_call().prefill_rows == 1
    for bad in (0, 5):
        with pytest.raises(ConfigError, match="prefill_batch_size"):
            dataclasses.replace(INFERENCE, prefill_batch_size=bad)


@pytest.mark.parametrize("sampling", [None, GREEDY], ids=["sampled", "greedy"])
def test_batched_prefill_gives_the_tokens_of_one_prompt_per_call(sampling):
    # Lengths in all three buckets, interleaved, so calls group rows by bucket.
    lengths = [3, 30, 7, 21, 1, 16, 9, 13, 5, 32, 8, 17]
    requests = [request(i, n, sampling) for i, n in enumerate(lengths)]
    single = make_engine(inference=one_per_call())
    batched = make_engine()
    want, got = single.run(requests), batched.run(requests)
    assert single.stats()["prefill_calls"] == len(requests)
    assert batched.stats()["prefill_calls"] < len(requests)  # some calls held several rows
    for a, b in zip(want, got, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason), a.request_id
        # Only the prefill's batch dimension differs: float rounding, a few ULPs at most.
        np.testing.assert_array_max_ulp(np.float32(a.logprobs), np.float32(b.logprobs), maxulp=4)


def test_one_call_prefills_a_bucket_of_different_prompt_lengths():
    engine = make_engine()
    lengths = [9, 3, 16, 12]  # buckets 16, 8, 16, 16: two calls, three rows in one of them
    requests = [request(i, n) for i, n in enumerate(lengths)]
    for r in requests:
        engine.submit(r)
    engine.step()
    stats = engine.stats()
    assert stats["prefills"] == 4 and stats["prefill_calls"] == 2
    assert stats["compiled"] == ["decode:4x1", "prefill:4x16", "prefill:4x8"]
    finished = {}
    while engine.has_work():
        finished.update((r.request_id, r) for r in engine.step())
    for r in requests:
        (alone,) = make_engine(inference=one_per_call()).run([r])
        assert finished[r.request_id].tokens == alone.tokens


def test_padding_rows_write_nothing_to_other_slots_or_the_padding_page():
    # A is decoding when B is prefilled alone: B's call carries three padding rows.
    a, b = request(0, 13), request(1, 6)
    engine = make_engine()
    engine.submit(a)
    engine.step()
    assert engine.stats()["active_slots"] == 1
    engine.submit(b)
    finished = {}
    while engine.has_work():
        finished.update((r.request_id, r) for r in engine.step())
    assert engine.stats()["prefill_calls"] == 2
    assert finished["r0"] == make_engine().run([a])[0]
    assert finished["r1"] == make_engine().run([b])[0]
    # Batched with others instead of padding: bitwise the same rollout.
    mixed = make_engine().run([request(5, 20), b, request(6, 2), request(7, 7)])
    assert mixed[1] == finished["r1"]
    keys, values = engine.read_kv_pages([0])  # page 0 (padding) is never written
    assert not any(np.asarray(x).any() for x in keys + values)


def test_out_of_pages_admission_stays_first_in_first_out_in_a_batch():
    # Reserve admission, 26 pages: r0 (32 + 12 tokens) and r1 (30 + 12) take 11 each; r2
    # (28 + 12) needs 10 of the 4 left and waits. r3 (1 + 12: 4 pages) would fit but must
    # not overtake r2.
    engine = make_engine(inference=RESERVE)
    requests = [request(i, n) for i, n in enumerate([32, 30, 28, 1])]
    for r in requests:
        engine.submit(r)
    engine.step()
    paging = engine.paging_state()
    assert {s for s in paging.slots if s is not None} == {"r0", "r1"}
    assert paging.waiting == ("r2", "r3")
    assert engine.stats()["prefill_calls"] == 1  # r0 and r1 share the 32 bucket
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2", "r3"]


def test_misuse_raises_clear_errors():
    engine = Engine(LLAMA, INFERENCE, seed=0)
    with pytest.raises(EngineNotLoadedError):
        engine.submit(request(0, 3))
    params = init_params(LLAMA)
    broken = {**params, "embed": np.zeros((3, 3), np.float32)}
    with pytest.raises(ParamsMismatchError, match="embed"):
        engine.load(0, broken)
    assert engine.version == -1
    engine.load(0, params)
    engine.submit(request(0, 3))
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(request(0, 3))


def test_engine_on_a_tensor_parallel_mesh_matches_one_device():
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=jax.devices()[:2])
    requests = [GenerationRequest(f"r{n}", "p", 0, prompt(n, n), GREEDY) for n in (3, 20)]
    params = init_params(LLAMA, seed=4)  # clear greedy margins, as in the recompute test
    sharded = make_engine(mesh=mesh, params=params).run(requests)
    single = make_engine(params=params).run(requests)
    for a, b in zip(sharded, single, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
