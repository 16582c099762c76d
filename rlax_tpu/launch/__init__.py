"""Starting and watching a run: `rlax-tpu run` / `resume` (`job.py`), the components as local
subprocesses (`launcher.py`) or at given addresses (`remote.py`), the metrics writers
(`metrics.py`, `wandb_logging.py`) and the prefilter (`prefilter.py`). The controller it
drives is rlax_tpu.controller; nothing here loads JAX except an in-process warm start."""
