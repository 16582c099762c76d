"""The controller: the one active process of a run. It draws prompts from the dataset mixture,
drives the inference workers, verifiers and trainer, writes metrics and snapshots, and recovers
a preempted run from its newest snapshot. `rlax-tpu run` and `resume` are
`launch.job.main` and `launch.job.resume`. Nothing in it imports JAX."""
