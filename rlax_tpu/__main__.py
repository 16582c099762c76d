import sys

from rlax_tpu.cli import main

sys.exit(main())
