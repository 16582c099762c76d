"""quickstart.py on a Python that cannot make a virtual environment with pip (Debian's
python3 without the python3-venv package): a message naming the fix, not a traceback."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def quickstart(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VENV", tmp_path / "venv")
    return module


def test_a_python_without_ensurepip_is_told_to_install_python3_venv(quickstart, monkeypatch):
    monkeypatch.setattr(quickstart, "has_ensurepip", lambda: False)
    with pytest.raises(SystemExit) as info:
        quickstart.ensure_installed("")
    assert "apt-get install python3-venv" in str(info.value.code)
    assert not quickstart.VENV.exists()


def test_a_failed_pip_bootstrap_is_explained_and_cleaned_up(quickstart, monkeypatch):
    class FailingBuilder:
        """What venv does when ensurepip cannot run: the interpreter is in place, then
        `python -m ensurepip` fails."""

        def __init__(self, **kwargs):
            pass

        def create(self, env_dir):
            (Path(env_dir) / "bin").mkdir(parents=True)
            (Path(env_dir) / "bin" / "python").write_text("")
            raise subprocess.CalledProcessError(1, ["python", "-m", "ensurepip"])

    monkeypatch.setattr(quickstart, "has_ensurepip", lambda: True)
    monkeypatch.setattr(quickstart.venv, "EnvBuilder", FailingBuilder)
    with pytest.raises(SystemExit) as info:
        quickstart.ensure_installed("")
    message = str(info.value.code)
    assert "apt-get install python3-venv" in message and "ensurepip" in message
    # Nothing half-made is left to be mistaken for a ready environment next time.
    assert not quickstart.VENV.exists()


def test_an_environment_without_pip_is_refused_with_the_fix(quickstart):
    (quickstart.VENV / "bin").mkdir(parents=True)
    (quickstart.VENV / "bin" / "python").write_text("")
    with pytest.raises(SystemExit) as info:
        quickstart.ensure_installed("")
    assert "without pip" in str(info.value.code) and "remove it" in str(info.value.code)
