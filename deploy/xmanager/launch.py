"""`xmanager launch deploy/xmanager/launch.py -- --config=CONFIG [--set=k=v ...]`: the entry
point `xmanager launch` needs (absl flags); the launcher is `rlax_tpu.deploy.xmanager`, also
run as `rlax-tpu deploy xmanager CONFIG [--dry-run]` (docs/deploy.md, "XManager").
"""

import sys
from pathlib import Path

try:
    import rlax_tpu  # noqa: F401
except ImportError:  # run from a source tree in an environment without the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from absl import app, flags  # noqa: E402 - xmanager's environment has absl

from rlax_tpu.deploy import DeployError  # noqa: E402
from rlax_tpu.deploy import xmanager as launcher  # noqa: E402

flags.DEFINE_string("config", None, "configs/*.py file (path inside the image too)")
flags.DEFINE_multi_string("set", [], "config override KEY=VALUE (repeatable)")
flags.DEFINE_bool("dry_run", False, "print the job specs as JSON; launch nothing")
flags.DEFINE_string("image", None, "container image (default: the config's deploy.image)")
flags.DEFINE_string(
    "address_template",
    launcher.DEFAULT_ADDRESS_TEMPLATE,
    "DNS name of a job from {experiment} and {job} (e.g. param_server_0)",
)
flags.DEFINE_string("experiment_title", None, "default: the config file's name")
flags.mark_flag_as_required("config")
FLAGS = flags.FLAGS


def main(argv):
    del argv  # flags only
    try:
        launcher.main(
            FLAGS.config,
            FLAGS.set,
            dry_run=FLAGS.dry_run,
            image=FLAGS.image,
            address_template=FLAGS.address_template,
            experiment_title=FLAGS.experiment_title,
        )
    except DeployError as e:
        sys.exit(f"launch.py: {e}")


if __name__ == "__main__":
    app.run(main)
