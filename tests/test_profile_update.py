"""tools/profile_update.py's reading of compiled programs (the Tunix side needs the peer
environment, tools/peer_env.py; what it reports of a program is checked here)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import profile_update  # noqa: E402


def test_opcodes_are_read_from_plain_tuple_and_root_instructions():
    lines = {
        "  %d = f32[2,3]{1,0} dot(%a, %b), lhs_contracting_dims={1}": "dot",
        "  %r = (f32[], s32[2]{0}) all-reduce(%x, %y), channel_id=2": "all-reduce",
        "  ROOT %t = (f32[], /*index=1*/f32[4]{0}) tuple(%a, %b)": "tuple",
        "  %p = f32[] parameter(0)": "parameter",
        "HloModule jit_f, entry_computation_layout={(f32[])->f32[]}": None,
        "%region_0.1 (a: f32[], b: f32[]) -> f32[] {": None,
    }
    assert {line: profile_update._opcode(line) for line in lines} == lines


def test_a_programs_profile_counts_its_matmul_flops_and_ops():
    def f(a, b):
        return jnp.tanh(a @ b).sum()

    a, b = jnp.ones((32, 64)), jnp.ones((64, 16))
    profile = profile_update.hlo_profile(jax.jit(f).lower(a, b).compile())
    assert profile["flops"] >= 2 * 32 * 64 * 16
    assert profile["flops"] < 2 * 32 * 64 * 16 * 1.5  # the tanh and sum are small beside it
    assert profile["transcendentals"] == 32 * 16
    assert profile["ops"].get("dot", 0) + profile["ops"].get("custom-call", 0) >= 1
    assert profile["instructions"] == sum(profile["ops"].values())
