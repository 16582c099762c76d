"""tools/gen_protos.py: reproducible output, importable cross-file imports, and the on-import
fallback of rlax_tpu.rpc.protos in a source tree that was never built."""

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "tools" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_protos = load_gen_protos()


def write_protos(root: Path) -> None:
    # Names unique to this test: the protobuf descriptor pool is process-global.
    (root / "gentest" / "v1").mkdir(parents=True)
    (root / "gentest" / "v1" / "base.proto").write_text(
        'syntax = "proto3";\npackage gentest.v1;\nmessage Base { int64 version = 1; }\n'
    )
    (root / "gentest" / "v1" / "svc.proto").write_text(
        textwrap.dedent("""\
            syntax = "proto3";
            package gentest.v1;
            import "gentest/v1/base.proto";
            import "google/protobuf/empty.proto";
            message Wrapped { Base base = 1; }
            service Svc { rpc Get(google.protobuf.Empty) returns (Wrapped); }
        """)
    )
    (root / "gentest_top.proto").write_text(
        'syntax = "proto3";\nimport "gentest/v1/base.proto";\n'
        "message Top { gentest.v1.Base b = 1; }\n"
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_byte_identical_on_rerun_and_imports_across_files(tmp_path, monkeypatch):
    protos, out = tmp_path / "protos", tmp_path / "genpkg"
    write_protos(protos)
    assert gen_protos.generate(protos, out, "genpkg")
    first = snapshot(out)
    assert gen_protos.generate(protos, out, "genpkg") == []
    assert snapshot(out) == first
    assert gen_protos.is_current(protos, out)

    monkeypatch.syspath_prepend(str(tmp_path))
    from genpkg import gentest_top_pb2
    from genpkg.gentest.v1 import svc_pb2, svc_pb2_grpc

    assert svc_pb2.Wrapped(base={"version": 3}).base.version == 3
    assert gentest_top_pb2.Top(b={"version": 1}).b.version == 1
    assert hasattr(svc_pb2_grpc, "SvcStub")


def test_changed_protos_make_output_stale_and_removed_protos_are_cleaned(tmp_path):
    protos, out = tmp_path / "protos", tmp_path / "genpkg"
    write_protos(protos)
    gen_protos.generate(protos, out, "genpkg")
    (protos / "gentest_top.proto").unlink()
    assert not gen_protos.is_current(protos, out)
    gen_protos.generate(protos, out, "genpkg")
    assert not (out / "gentest_top_pb2.py").exists()
    assert (out / "gentest" / "v1" / "svc_pb2.py").exists()


def copy_source_tree(dst: Path) -> None:
    shutil.copytree(REPO / "protos", dst / "protos")
    shutil.copytree(REPO / "tools", dst / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "rlax_tpu" / "rpc").mkdir(parents=True)
    shutil.copy(REPO / "rlax_tpu" / "__init__.py", dst / "rlax_tpu")
    for module in (REPO / "rlax_tpu" / "rpc").glob("*.py"):
        shutil.copy(module, dst / "rlax_tpu" / "rpc")


def run_python(cwd: Path, code: str) -> subprocess.CompletedProcess:
    # The copy (cwd, PYTHONPATH) shadows the editable install of the real checkout.
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_unbuilt_source_tree_generates_code_on_import(tmp_path):
    copy_source_tree(tmp_path)
    code = "import rlax_tpu.rpc as r; print(r.common_pb2.__file__)"
    result = run_python(tmp_path, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path / "rlax_tpu" / "rpc" / "gen"))
    assert gen_protos.is_current(tmp_path / "protos", tmp_path / "rlax_tpu" / "rpc" / "gen")


def test_missing_grpcio_tools_gives_an_install_hint(tmp_path):
    copy_source_tree(tmp_path)
    result = run_python(
        tmp_path, "import sys; sys.modules['grpc_tools'] = None; import rlax_tpu.rpc.protos"
    )
    assert result.returncode != 0
    assert "pip install" in result.stderr and "grpcio-tools" in result.stderr


@pytest.mark.parametrize("module", ["common_pb2", "common_pb2_grpc"])
def test_checked_out_tree_has_current_generated_code(module):
    from rlax_tpu.rpc import protos

    assert gen_protos.is_current()
    assert getattr(protos, module).__name__.startswith("rlax_tpu.rpc.gen.")
