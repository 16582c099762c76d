"""`rlax-tpu compile`: a config's programs compiled by libtpu for abstract TPU devices.

The CLI runs in a subprocess, as users run it: it sets up JAX for libtpu's compiler itself.
The pod configs' full compiles take minutes each and are marked slow.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.cli import main
from rlax_tpu.compile.hlo_cost import analyze, mean_taps
from rlax_tpu.compile.measure import ProgramReport, refusal
from rlax_tpu.compile.report import CompileReport, ComponentTarget, format_report
from rlax_tpu.config import TPU_CHIPS, ConfigError, load_config
from rlax_tpu.hardware import CHIPS, FIT_FRACTION, GiB
from rlax_tpu.inference.capacity import kv_capacity
from rlax_tpu.simulator.model import train_flops_per_token

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "tests" / "compile_tiny_config.py")


def _compile(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    return subprocess.run(
        [sys.executable, "-m", "rlax_tpu", "compile", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_tiny_model_compiles_for_v5p_with_per_chip_figures(tmp_path):
    out = tmp_path / "report.json"
    proc = _compile(TINY, "--json", str(out), "--save-compiled", str(tmp_path / "compiled"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # libtpu's warnings about the missing TPU VM are not shown.
    assert "TPU_ACCELERATOR_TYPE" not in proc.stdout + proc.stderr
    assert "fits: every program within 90% of HBM" in proc.stdout
    report = json.loads(out.read_text())
    assert report["fits"] and not report["problems"]
    for component in ("trainer", "inference"):
        target = report["components"][component]
        assert (target["topology"], target["chip"], target["num_chips"]) == ("v5p:2x2x1", "v5p", 4)
        assert target["hbm_bytes_per_chip"] == 95 * GiB
    assert report["components"]["trainer"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    programs = {p["name"]: p for p in report["programs"]}
    # Every program of the run: start-up, the train step's two, the worker's at every bucket
    # (one each here) and its swap copies. sft_step runs only with an SFT warm start
    # (trainer.warm_start.steps = 0 here); publish only when the served params differ from the
    # params (float32 params served as float32, unstacked: not here).
    assert [p["name"] for p in report["programs"]] == [
        "init",
        "init_opt",
        "rl_step",
        "recompute",
        "prefill",
        "decode",
        "swap_out",
        "swap_in",
    ]
    for p in (programs[name] for name in ("rl_step", "recompute", "prefill", "decode")):
        memory = p["memory"]
        assert all(v >= 0 for v in memory.values()), (p["name"], memory)
        assert 0 < memory["total"] <= FIT_FRACTION * p["hbm_bytes"]
        assert memory["params"] > 0
        assert p["flops"] > 0 and p["bytes_accessed"] > 0 and p["roofline_s"] > 0
        assert p["compile_s"] > 0 and p["fits"]
    # The train step holds the optimizer state and builds a gradient tree; donation writes
    # the new params and state over the old ones.
    rl = programs["rl_step"]["memory"]
    # Adam's two moments, sharded like the params, and its replicated step counters.
    assert 2 * rl["params"] <= rl["optimizer_state"] < 2 * rl["params"] + 1024
    assert rl["gradients"] == rl["params"] and rl["alias"] > 0
    assert programs["rl_step"]["dims"] == {
        "rows": 8,
        "seq_len": 128,
        "micro_batch": 4,
        "updates": 1,
    }
    assert programs["prefill"]["dims"] == {"rows": 1, "seq_len": 32}
    assert programs["decode"]["dims"] == {"slots": 8, "steps": 1, "max_seq_len": 64}
    # The decode step compiles the real Pallas paged-attention kernel (not interpreted), at
    # the largest of the engine's decode buckets (8 slots: one bucket).
    assert "pallas_tpu" in programs["decode"]["shape"]
    assert "8 of 8 slots" in programs["decode"]["shape"]
    assert programs["decode"]["hlo"]["kernels_without_cost"] >= 1
    assert programs["decode"]["memory"]["kv_cache"] > 0
    assert report["train_step_roofline_s"] > 0
    # Start-up: the random init writes the params; the optimizer's init reads them and
    # writes Adam's moments beside them.
    init, init_opt = programs["init"]["memory"], programs["init_opt"]["memory"]
    assert init["outputs"] >= rl["params"] and init["total"] <= rl["total"]
    assert init_opt["params"] == rl["params"] and init_opt["outputs"] >= 2 * rl["params"]
    # The params are on the chip while their optimizer state is made, read or not.
    assert init_opt["total"] >= init_opt["params"] + init_opt["outputs"]
    # The swap copies move one sequence's pages while the pool and the weights stay put.
    for name in ("swap_out", "swap_in"):
        swap = programs[name]["memory"]
        assert swap["kv_cache"] == programs["decode"]["memory"]["kv_cache"]
        assert swap["params"] == programs["decode"]["memory"]["params"] and programs[name]["fits"]
    assert programs["swap_out"]["dims"] == {"pages": 4}  # 64 tokens: 4 pages of 16
    # Cost to plan with: model FLOPs (6·N + attention per trained token, a third of it per
    # token of a forward pass) against the compiled ones, the estimated time at the stated
    # efficiency, and MFU at both.
    config = load_config(TINY)
    per_token = train_flops_per_token(config.model, 128)
    rl_cost, recompute_cost = programs["rl_step"]["cost"], programs["recompute"]["cost"]
    assert rl_cost["model_flops"] == pytest.approx(per_token * 8 * 128 / 4)
    assert recompute_cost["model_flops"] == pytest.approx(rl_cost["model_flops"] / 3)
    for cost in (rl_cost, recompute_cost, programs["prefill"]["cost"]):
        assert 0 < cost["mfu_estimated"] < cost["mfu_at_roofline"] <= 1
    assert rl_cost["estimated_s"] == pytest.approx(programs["rl_step"]["roofline_s"] / 0.4)
    assert programs["init"]["cost"]["mfu_estimated"] is None  # no model work
    step = report["train_step"]
    assert step["compiled_flops"] == pytest.approx(
        programs["rl_step"]["flops"] + 2 * programs["recompute"]["flops"]
    )
    assert step["extra_flops"]["reference"] == step["extra_flops"]["pi_old"]  # a KL term here
    assert step["mfu_estimated"] == pytest.approx(step["mfu_at_roofline"] * 0.4)
    assert "train step (recompute × calls + rl_step), per chip: model" in proc.stdout
    # The executables, kept for a run on this topology (trainer.compiled_dir and
    # inference.compiled_dir): the inference programs at each of their buckets.
    manifest = json.loads((tmp_path / "compiled" / "manifest.json").read_text())
    trainer = {"init", "init_opt", "rl_step", "recompute"}
    inference = {"prefill@32", "decode@8", "swap_out@4", "swap_in@4"}
    assert set(manifest) == trainer | inference
    rl_entry = manifest["rl_step"]
    assert (rl_entry["platform"], rl_entry["num_devices"]) == ("tpu", 4)
    assert rl_entry["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    assert manifest["decode@8"]["platform"] == "tpu"
    assert (tmp_path / "compiled" / rl_entry["file"]).stat().st_size > 0
    # Training attention is the splash kernel, its matmuls counted from its shapes.
    assert programs["rl_step"]["hlo"]["splash_kernels"] >= 1
    assert programs["recompute"]["hlo"]["splash_kernels"] >= 1
    # The inference worker's KV capacity (64 MiB of 1 KiB tokens: 4095 usable pages of 16),
    # as rlax_tpu.inference.capacity computes it; every slot fits either way.
    config = load_config(TINY)
    assert report["kv_capacity"] == kv_capacity(config.model, config.inference).to_json()
    assert report["kv_capacity"]["tokens"] == 4095 * 16
    assert report["kv_capacity"]["concurrent_sequences_reserved"] == 8
    assert "inference KV pool, per worker: 65,520 tokens" in proc.stdout


def test_programs_that_do_not_fit_are_refused_naming_the_knobs(tmp_path):
    out = tmp_path / "report.json"
    proc = _compile(
        TINY,
        "--programs",
        "rl_step,decode",
        # Over 90% of HBM by our count: a 90 GiB KV pool (2 kv heads: replicated).
        "--set",
        f"inference.kv_cache_bytes={90 * GiB}",
        # Over HBM by the compiler's: float32 [s, s] attention scores of 131072 tokens.
        "--set",
        "trainer.attention_backend=jax",
        "--set",
        "trainer.max_seq_len=131072",
        "--json",
        str(out),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    decode, rl_step = sorted(
        (line for line in proc.stderr.splitlines() if "does not fit" in line),
        key=lambda line: "rl_step" in line,
    )
    assert "the biggest consumer is kv cache" in decode
    assert "inference.kv_cache_bytes" in decode
    assert "RESOURCE_EXHAUSTED" in rl_step and "the compiler ran out of HBM" in rl_step
    assert "activations and temporaries" in rl_step and "trainer.remat_policy" in rl_step
    assert "trainer.max_seq_len=131072" in rl_step  # the current values are named
    # Where each was compiled for: the mesh (its -1 axis marked), topology, slices, chips.
    assert "on the trainer mesh data 1 × fsdp 2 × tensor 2 over v5p:2x2x1 (1 slice; 4 chips)" in (
        rl_step
    )
    assert "on the inference mesh data 1 × fsdp 1 × tensor 4 (-1) over v5p:2x2x1" in decode
    report = json.loads(out.read_text())
    assert not report["fits"] and len(report["problems"]) == 2
    programs = {p["name"]: p for p in report["programs"]}
    assert programs["rl_step"]["out_of_memory"] and not programs["decode"]["out_of_memory"]
    assert programs["decode"]["hbm_fraction"] > FIT_FRACTION


def test_a_refusal_names_the_mesh_and_a_minus_one_axis_left_nothing():
    # A v5p-64 trainer (fsdp -1, tensor 4) compiled for a v5p-8: fsdp comes out at 1.
    config = load_config(TINY)
    v5p = CHIPS["v5p"]
    report = ProgramReport(
        "rl_step", "trainer", "8 × 128 tokens", "once", 1, "v5p", {}, v5p.hbm_bytes
    )
    report.memory = {"optimizer_state": 200 * GiB, "total": 229 * GiB}
    small = ComponentTarget(
        "trainer", "v5p:2x2x1", v5p, 4, {"data": 1, "fsdp": 1, "tensor": 4}, rest_axis="fsdp"
    )
    text = refusal(report, config, small)
    assert text.startswith(
        "trainer rl_step (8 × 128 tokens) on the trainer mesh data 1 × fsdp 1 (-1) × tensor 4 "
        "over v5p:2x2x1 (1 slice; 4 chips) does not fit a v5p chip: 229.0 GiB needed"
    )
    assert "trainer.mesh.fsdp=-1 resolved to 1: the 4 chips of v5p:2x2x1 are all taken" in text
    two = ComponentTarget(
        "trainer",
        "v5p:2x2x1",
        v5p,
        8,
        {"data": 2, "fsdp": 2, "tensor": 2},
        num_slices=2,
        rest_axis="fsdp",
    )
    text = refusal(report, config, two)
    assert "over v5p:2x2x1 (2 slices, data across them; 8 chips)" in text
    assert "resolved" not in text


# ~13 s: `-m slow`. The default run builds the two-slice mesh (the DCN axis test below) and
# compiles for one slice (above); this compiles the step over two.
@pytest.mark.slow
def test_tiny_model_compiles_for_two_slices_with_data_across_them(tmp_path):
    out = tmp_path / "report.json"
    # One --set at a time stays valid: fsdp takes the rest, data 2 on one slice, then two.
    slices = ["trainer.mesh.fsdp=-1", "trainer.mesh.data=2", "trainer.mesh.num_slices=2"]
    sets = [a for s in slices for a in ("--set", s)]
    proc = _compile(TINY, *sets, "--programs", "rl_step", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "trainer: 2 slices of v5p:2x2x1 (8 chips; mesh data 2 × fsdp 2 × tensor 2, data "
        "across the slices over DCN)"
    ) in proc.stdout
    trainer = json.loads(out.read_text())["components"]["trainer"]
    assert (trainer["topology"], trainer["num_slices"], trainer["num_chips"]) == (
        "v5p:2x2x1",
        2,
        8,
    )
    assert trainer["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert trainer["dcn_axis"] == "data"


MESH_SLICES = """
import json
import numpy as np
from rlax_tpu.hardware import prepare_environment
prepare_environment()
from rlax_tpu.compile.topology import topology_mesh
from rlax_tpu.config import MeshConfig
out = {}
for axis, data in (("data", 2), ("fsdp", 1)):
    config = MeshConfig(data=data, fsdp=-1, tensor=2, num_slices=2, dcn_axis=axis)
    mesh = topology_mesh(config, "v5p:2x2x1")
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    out[axis] = {"shape": dict(mesh.shape), "slices": slices.tolist()}
print(json.dumps(out))
"""


def test_the_dcn_axis_of_a_two_slice_mesh_spans_the_slices():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    done = subprocess.run(
        [sys.executable, "-c", MESH_SLICES], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    meshes = json.loads(done.stdout.splitlines()[-1])
    data = meshes["data"]
    assert data["shape"] == {"data": 2, "fsdp": 2, "tensor": 2}
    # data index i lies in slice i; fsdp and tensor stay within it (ICI).
    assert data["slices"] == [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]
    fsdp = meshes["fsdp"]
    assert fsdp["shape"] == {"data": 1, "fsdp": 4, "tensor": 2}
    # fsdp across the slices: its first two positions in slice 0, the next two in slice 1.
    assert fsdp["slices"] == [[[0, 0], [0, 0], [1, 1], [1, 1]]]


def test_report_carries_the_kv_capacity_of_the_inference_worker():
    # No compile: the capacity is arithmetic on the config, reported with the programs.
    config = load_config(str(ROOT / "configs" / "llama3_1_8b_tpu_v5p_64.py"))
    capacity = kv_capacity(config.model, config.inference)
    report = CompileReport(config.name, config.digest(), {}, [], [], capacity)
    text = format_report(report)
    on_demand = capacity.concurrent_sequences_on_demand
    assert (
        "inference KV pool, per worker: 393,152 tokens (6,143 pages of 64; 128 KiB a token)" in text
    )
    assert f"on_demand (in use): {on_demand} concurrent sequences (bound: KV pages)" in text
    assert "reserve: 23 concurrent sequences of 16,384 reserved tokens" in text
    data = report.to_json()["kv_capacity"]
    assert data["concurrent_sequences_on_demand"] == on_demand >= 4 * 23
    assert (data["concurrent_sequences_reserved"], data["tokens"]) == (23, 393152)
    assert data["admission"] == "on_demand" and data["concurrent_sequences"] == on_demand
    # Without an inference program there is no inference worker to size.
    trainer_only = CompileReport(config.name, config.digest(), {}, [], [])
    assert trainer_only.to_json()["kv_capacity"] is None
    assert "KV pool" not in format_report(trainer_only)


def test_topology_disagreeing_with_the_deploy_slice_is_refused(capsys):
    # 4 chips, as the mesh needs, but v5e where the deployment rents a v5p slice.
    code = main(["compile", TINY, "--set", "trainer.mesh.topology=v5e:2x2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "trainer.mesh.topology" in err and "deploy.trainer_tpu" in err


def test_topology_follows_the_deploy_slice_when_unset():
    config = load_config(TINY, ["trainer.mesh.topology=", "deploy.trainer_tpu.topology=2x2x2"])
    assert config.tpu_topology("trainer") == "v5p:2x2x2"
    with pytest.raises(ConfigError, match="must fill its topology"):
        load_config(TINY, ["trainer.mesh.topology=v5p:4x4x4"])
    with pytest.raises(ConfigError, match="chip one of"):
        load_config(TINY, ["inference.mesh.topology=v9:2x2"])
    # A bad axis size is named as such, before the topology is checked against it.
    with pytest.raises(ConfigError, match="data: must be >= 1"):
        load_config(TINY, ["trainer.mesh.data=0"])


def test_shipped_pod_configs_name_their_slices():
    for name, trainer in (
        ("llama3_1_8b_tpu_v5p_64", "v5p:2x4x4"),
        ("qwen2_5_32b_tpu_v5p_256", "v5p:4x4x8"),
    ):
        config = load_config(str(ROOT / "configs" / f"{name}.py"))
        assert config.tpu_topology("trainer") == trainer
        assert config.tpu_topology("inference") == "v5p:2x2x1"


def test_chip_table_matches_the_published_figures():
    assert set(CHIPS) == set(TPU_CHIPS)  # every chip a topology may name has figures
    v5p = CHIPS["v5p"]
    assert (v5p.hbm_bytes, v5p.peak_flops_per_s, v5p.hbm_bytes_per_s) == (95 * GiB, 459e12, 2765e9)
    assert {c: CHIPS[c].hbm_bytes // GiB for c in CHIPS} == {
        "v4": 32,
        "v5e": 16,
        "v5p": 95,
        "v6e": 32,
    }


# -- the HLO walk ---------------------------------------------------------------------------
# libtpu's optimized HLO (v5p, 4 devices; metadata stripped) of
#   lax.scan(lambda c, x: (c + tanh(x @ w).sum(), None), 0., xs), xs: f32[10, 4096, 1024]
# sharded 4 ways: the matmul is a convolution inside a while loop of 10 iterations that
# reads one [1024, 1024] slice of the stacked (bf16) xs per iteration.
SCAN_HLO = (ROOT / "tests" / "hlo" / "scan_v5p.txt").read_text()
# An attention the compiler turned into a Mosaic kernel carrying its cost estimate.
KERNEL_HLO = (ROOT / "tests" / "hlo" / "kernel_v5p.txt").read_text()


def test_hlo_walk_counts_loop_bodies_by_their_trip_count():
    cost = analyze(SCAN_HLO)
    assert cost.loops == [("while.10", 10)] and cost.unknown_loops == 0
    assert cost.flops == 10 * 2 * 1024**3  # XLA's cost_analysis counts the body once
    # Each iteration reads one 2 MiB slice of the 20 MiB stacked array, not all of it.
    slice_bytes, stacked_bytes = 2 * 2**20, 20 * 2**20
    assert 10 * slice_bytes < cost.bytes_accessed < 10 * stacked_bytes


def test_hlo_walk_reads_a_loops_start_and_step():
    # A loop like the SPMD partitioner's windowed matmuls: i = 0, 2 while i < 4: twice.
    cost = analyze((ROOT / "tests" / "hlo" / "windowed_loop.txt").read_text())
    assert cost.loops == [("w", 2)]
    assert cost.flops == 2 * (2 * 8 * 8 * 8)


def test_convolution_taps_skip_padding_and_dilation_holes():
    # A batched matmul written as a convolution: each output position meets one input
    # element of the window, through padding (heads) or lhs dilation (kv heads).
    assert mean_taps(1, 4, 4, {"size": 4, "pad_lo": 3}) == 1.0
    assert mean_taps(2, 2, 2, {"size": 2, "lhs_dilate": 2}) == 1.0
    # A weight gradient contracts over its whole window.
    assert mean_taps(2, 1, 2, {"size": 2}) == 2.0


def test_shared_prompts_are_refused_where_auto_resolves_to_splash_attention():
    """On TPU, attention_backend=auto is splash, whose masks cannot express a shared prompt:
    the compile stops before compiling anything, naming the knob to set."""
    proc = _compile(
        TINY, "--set", "trainer.tokens_per_row=128", "--set", "trainer.share_prefixes=true"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trainer.share_prefixes: attention_backend=auto runs splash attention on tpu" in (
        proc.stderr
    )
    assert "set trainer.attention_backend=jax" in proc.stderr


def test_hlo_walk_reads_kernel_cost_estimates():
    cost = analyze(KERNEL_HLO)
    assert cost.flops == 4294967296 and cost.kernels_without_cost == 0
    without = analyze(KERNEL_HLO.replace('"cost_estimate"', '"no_estimate"'))
    assert without.flops == 0 and without.kernels_without_cost == 1


# -- the shipped pod configs (minutes each) ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_1_8b_tpu_v5p_64", "qwen2_5_32b_tpu_v5p_256"])
def test_pod_config_fits_its_topology(name, tmp_path):
    out = tmp_path / "report.json"
    proc = _compile(str(ROOT / "configs" / f"{name}.py"), "--json", str(out), timeout=7200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for p in report["programs"]:
        assert p["memory"]["total"] <= FIT_FRACTION * p["hbm_bytes"], p["name"]


def test_the_batch_search_bisects_to_the_largest_value_that_fits():
    from rlax_tpu.compile.search import largest_fitting

    probes = []

    def fits(value):
        probes.append(value)
        return value <= 24, "" if value <= 24 else f"{value} is over"

    best, tried = largest_fitting([1, 2, 4, 8, 16, 24, 32, 64], fits)
    assert best == 24 and len(probes) == 3  # log2 of 8 candidates
    assert [v for v, ok, _ in tried if not ok] == [32]
    assert largest_fitting([4, 8], lambda v: (False, "no"))[0] is None


def test_the_batch_search_tries_only_values_the_config_accepts():
    from rlax_tpu.compile.search import candidates

    config = load_config(TINY)  # mini-batch 8; prompts of 32 + 32 new tokens
    assert candidates(config, "micro_batch") == [1, 2, 4, 8]
    seq = candidates(config.override("model.max_position_embeddings", 1024), "max_seq_len")
    assert seq == [64, 256, 512, 768, 1024]


@pytest.mark.slow
def test_find_max_compiles_each_probe_and_names_the_set(tmp_path):
    # float32 attention scores [micro, heads, s, s] at 16k tokens: 13.5 GiB a chip at a
    # micro-batch of 8 (measured), twice that at 16, over a v5e chip's 16 GiB.
    sets = [
        "trainer.attention_backend=jax",
        "trainer.max_seq_len=16384",
        "trainer.mesh.topology=v5e:2x2",
        "trainer.mini_batch_size=16",
        "controller.prompts_per_batch=8",
    ]
    proc = _compile(TINY, *[x for s in sets for x in ("--set", s)], "--find-max", "micro_batch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest trainer.micro_batch_size that fits: 8" in proc.stdout
    assert "trainer.micro_batch_size=16: does not fit" in proc.stdout
    assert "--set trainer.micro_batch_size=8" in proc.stdout


def test_episodes_compile_the_extend_program_at_every_prefill_bucket(tmp_path):
    """A run with episodes feeds each next turn after its cached pages (the extend step):
    `rlax-tpu compile` lowers it for the TPU at the prefill buckets, with its memory and
    FLOPs; a run without continuations leaves it out."""
    out = tmp_path / "report.json"
    proc = _compile(
        TINY, "--programs", "prefill,extend", "--json", str(out),
        "--set", "controller.environment.name=tools",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    programs = {p["name"]: p for p in report["programs"]}
    assert list(programs) == ["prefill", "extend"]
    extend, prefill = programs["extend"], programs["prefill"]
    assert extend["dims"] == prefill["dims"] and extend["fits"]
    assert "after cached pages" in extend["shape"]
    assert extend["memory"]["kv_cache"] == prefill["memory"]["kv_cache"] > 0
    assert extend["flops"] > 0 and extend["cost"]["model_flops"] > 0
    assert "inference extend@32" in proc.stdout
    plain = _compile(TINY, "--programs", "prefill,extend", "--json", str(out))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert [p["name"] for p in json.loads(out.read_text())["programs"]] == ["prefill"]


def test_int8_serving_is_sized_and_rooflined_with_its_int8_weights(tmp_path):
    """inference.weight_dtype=int8: the worker's decode holds the int8 projections (and their
    scales) instead of bf16 ones, and its bytes per call (the roofline) fall with them: the
    dequantization is fused into the dots, no bf16 copy of a weight is read. A model whose
    projections are most of its weights and a small KV pool, so the weights show."""
    sized = ["--set", "model.publish_dtype=bfloat16", "--set", "model.hidden_size=512"]
    sized += ["--set", "model.intermediate_size=2048", "--set", "inference.kv_cache_bytes=1048576"]
    decode = {}
    for weight_dtype in ("", "int8"):
        out = tmp_path / f"{weight_dtype or 'bf16'}.json"
        proc = _compile(
            TINY, "--programs", "decode", "--json", str(out), *sized,
            "--set", f"inference.weight_dtype={weight_dtype}",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        decode[weight_dtype] = json.loads(out.read_text())["programs"][0]
    bf16, int8 = decode[""], decode["int8"]
    assert "int8 projections" in int8["shape"] and "projections" not in bf16["shape"]
    # Projections 1 byte a weight (bf16: 2) plus float32 scales; embedding and lm_head bf16.
    assert 0.5 < int8["memory"]["params"] / bf16["memory"]["params"] < 0.56
    # Measured 0.60 (v5p, libtpu of jax 0.10.2): weights are most of what a decode call reads.
    assert int8["bytes_accessed"] < 0.7 * bf16["bytes_accessed"]
    assert int8["roofline_s"] < 0.7 * bf16["roofline_s"] and int8["bound"] == "memory"
