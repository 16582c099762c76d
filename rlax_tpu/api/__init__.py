"""The contract between processes: everything that crosses a process boundary (a wire, or a
file another process reads back), in one place and JAX-free, so that any process imports it
cheaply. `records`: the rollouts, verdicts and groups of the RL loop, and their on-disk form.
"""
