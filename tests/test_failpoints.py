"""Failpoints (rlax_tpu/failpoints.py): a process told to die at a named place dies there,
once per run, and a bad spec is refused naming the entry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rlax_tpu import failpoints

PASS_POINT = (
    "from rlax_tpu.failpoints import failpoint\n"
    "failpoint('trainer.checkpoint', 3)\n"
    "failpoint('trainer.checkpoint', 4)\n"
    "print('went on')\n"
)


def pass_point(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PASS_POINT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_failpoint_kills_its_process_once_per_run(tmp_path):
    env = {failpoints.ENV: "trainer.checkpoint@4", failpoints.DIR_ENV: str(tmp_path)}
    first = pass_point(env)
    assert first.returncode == -signal.SIGKILL and "went on" not in first.stdout
    assert "FAILPOINT trainer.checkpoint@4" in first.stderr
    assert os.listdir(tmp_path) == ["trainer.checkpoint@4"]
    again = pass_point(env)  # the restarted process passes the same point
    assert again.returncode == 0 and "went on" in again.stdout


def test_without_failpoints_nothing_happens_and_any_key_matches_star(tmp_path):
    assert pass_point({failpoints.ENV: ""}).returncode == 0
    env = {failpoints.ENV: "trainer.checkpoint@*", failpoints.DIR_ENV: str(tmp_path)}
    assert pass_point(env).returncode == -signal.SIGKILL
    assert os.listdir(tmp_path) == ["trainer.checkpoint@3"]  # the first key it passed


@pytest.mark.parametrize("spec", ["trainer.checkpont@3", "trainer.checkpoint", "controller@"])
def test_a_bad_spec_is_refused_naming_the_entry(spec):
    with pytest.raises(ValueError, match="is not NAME@KEY"):
        failpoints.parse(f"param_server.persist@2,{spec}")


def test_a_failpoint_without_its_directory_is_an_error(monkeypatch):
    monkeypatch.setattr(failpoints, "_POINTS", {"trainer.publish": {"1"}})
    monkeypatch.delenv(failpoints.DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match=failpoints.DIR_ENV):
        failpoints.failpoint("trainer.publish", 1)
    failpoints.failpoint("trainer.publish", 2)  # another key: not this point
