#!/usr/bin/env python3
"""One-command accelerator check of a GPU or TPU host, as `rlax-tpu bench device`: the
engine's decode rate against the HBM roofline, the trainer's MFU, the kernels' numerics, the
GSM8K recipe's first steps and the weight sync (tools/device_check.py; --help lists its
options)."""

import sys

from device_check import main

if __name__ == "__main__":
    sys.exit(main())
