"""The contract between processes: everything that crosses a process boundary (a wire, or a
file another process reads back), in one place and JAX-free, so that any process imports it
cheaply. One module per component in one shape — its request and response types, its errors
and the gRPC status each maps to, the proto codecs both ends use, and its client:
`inference`, `trainer`, `param_server`, `verifier`; `tensors`: the boxes, pieces, digests and
dtype codec the trainer's and the parameter server's wire formats share; `records`: the
rollouts, verdicts and groups of the RL loop, and their on-disk form; `environments`: what a
multi-turn episode's environment and its tools take and give.
"""
