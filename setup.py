"""Build hook: compile protos/ into rlax_tpu/rpc/gen before packaging (see tools/gen_protos.py).

All metadata lives in pyproject.toml. setuptools runs build_py for wheels and for editable
installs (`pip install -e .`), so both get freshly generated gRPC code.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_ROOT = Path(__file__).resolve().parent


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", _ROOT / "tools" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    def run(self):
        gen = _gen_protos()
        gen.generate()
        # packages were discovered before the code existed: add the generated ones now.
        out = Path(gen.OUT_DIR)
        generated = sorted(
            ".".join([gen.GEN_PACKAGE, *p.parent.relative_to(out).parts])
            for p in out.rglob("__init__.py")
        )
        self.packages = list(dict.fromkeys([*(self.packages or []), *generated]))
        for package in generated:
            self.package_data.setdefault(package, []).append("*.pyi")
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
