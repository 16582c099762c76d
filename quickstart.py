#!/usr/bin/env python3
"""Bootstrap and run rlax_tpu with nothing installed beyond Python 3.11+.

    python3 quickstart.py run    # tiny end-to-end job on the CPU (configs/tiny_cpu.py)
    python3 quickstart.py test   # the test suite

Creates a virtual environment in .venv (or $RLAX_TPU_VENV), installs the package
into it (with the `test` extra for `test`) and re-installs only when pyproject.toml,
setup.py or protos/ change. Arguments after the command go to `rlax-tpu run` or pytest.

`test` runs pytest on min(4, CPUs) worker processes (pytest-xdist, work stealing): the
suite is mostly single-threaded compilation and short-lived component processes, so one
process keeps about one core busy. $RLAX_TPU_TEST_WORKERS sets the number (0: one
process); a `-n`/`--numprocesses` or `-p no:xdist` argument is left as given.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("RLAX_TPU_VENV", ROOT / ".venv"))
# Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a separate package.
NO_ENSUREPIP = (
    "this Python ({python}) cannot create a virtual environment with pip: {reason}. "
    "On Debian/Ubuntu install the venv package (as root: apt-get install python3-venv), or "
    "run quickstart.py with a Python that has ensurepip (python.org builds, pyenv, uv, conda)."
)


def _bin(name: str) -> Path:
    return VENV / ("Scripts" if os.name == "nt" else "bin") / name


def _install_inputs_digest(extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    files = [
        ROOT / "pyproject.toml",
        ROOT / "setup.py",
        *sorted((ROOT / "protos").rglob("*.proto")),
    ]
    for path in files:
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def ensure_installed(extra: str) -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - this file runs on any python3
        sys.exit(f"rlax_tpu needs Python >= 3.11; this is {sys.version.split()[0]}")
    if not _bin("python").exists():
        create_venv()
    elif not (_bin("pip").exists() or _bin("pip.exe").exists()):
        sys.exit(
            f"{VENV} is a virtual environment without pip (made by a failed or --without-pip "
            "venv creation); remove it and run quickstart.py again"
        )
    stamp = VENV / f".rlax_tpu_installed_{extra or 'base'}"
    digest = _install_inputs_digest(extra)
    if stamp.exists() and stamp.read_text() == digest:
        return
    target = f".[{extra}]" if extra else "."
    print(f"installing rlax_tpu{f'[{extra}]' if extra else ''} into {VENV}", flush=True)
    subprocess.run(
        [str(_bin("python")), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True
    )
    subprocess.run(
        [str(_bin("python")), "-m", "pip", "install", "--quiet", "-e", target],
        cwd=ROOT,
        check=True,
    )
    stamp.write_text(digest)


def has_ensurepip() -> bool:
    return importlib.util.find_spec("ensurepip") is not None


def create_venv() -> None:
    """Create VENV with pip; without ensurepip, say how to get it and exit non-zero, leaving
    no half-made environment behind (one without pip would be taken as ready next time)."""
    python = f"{sys.executable} {sys.version.split()[0]}"
    if not has_ensurepip():
        sys.exit(NO_ENSUREPIP.format(python=python, reason="it has no ensurepip module"))
    print(f"creating virtual environment {VENV}", flush=True)
    existed = VENV.exists()
    try:
        venv.EnvBuilder(with_pip=True).create(VENV)
    except (subprocess.CalledProcessError, OSError) as e:
        if not existed:
            shutil.rmtree(VENV, ignore_errors=True)
        sys.exit(
            NO_ENSUREPIP.format(python=python, reason=f"installing pip into {VENV} failed ({e})")
        )


def _workers(pytest_args: list[str]) -> list[str]:
    """pytest-xdist arguments for the test command, unless the caller chose."""
    chosen = any(
        a in ("-n", "--numprocesses", "no:xdist", "-pno:xdist")
        or a.startswith("--numprocesses=")
        or (a.startswith("-n") and a[2:].lstrip("=") in ("auto", "logical"))
        or (a.startswith("-n") and a[2:].lstrip("=").isdigit())
        for a in pytest_args
    )
    if chosen:
        return []
    workers = int(os.environ.get("RLAX_TPU_TEST_WORKERS", min(4, os.cpu_count() or 1)))
    return ["-n", str(workers), "--dist", "worksteal"] if workers > 1 else []


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        ensure_installed("")
        args = [str(_bin("rlax-tpu")), "run", str(ROOT / "configs" / "tiny_cpu.py"), *rest]
    else:
        ensure_installed("test")
        args = [str(_bin("python")), "-m", "pytest", *_workers(rest), *rest]
    return subprocess.call(args, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
