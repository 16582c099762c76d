"""rlax_tpu: JAX RL post-training for LLMs (RLAX design). See docs/architecture.md."""

__version__ = "0.1.0"
