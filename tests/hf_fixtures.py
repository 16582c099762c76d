"""Tiny random Hugging Face models of the three supported architectures, for parity tests.

Weights are drawn at a scale where attention is far from uniform (so RoPE, q/k norms and
biases change the logits visibly), and norm weights and biases are randomised too, so a
missed or misplaced mapping cannot hide behind an all-ones or all-zeros tensor.
"""

from __future__ import annotations

import math

import torch
import transformers

VOCAB = 300

# Architecture -> transformers config. Each exercises what is special about its family:
# Llama 3 RoPE scaling with untied embeddings; Qwen2 q/k/v bias with tied embeddings;
# Qwen3 q/k norms with head_dim != hidden / heads.
HF_CONFIGS = {
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=1000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        rope_theta=1000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}
ARCHITECTURES = tuple(HF_CONFIGS)


def make_hf_model(architecture: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 eager-attention model with every weight, norm and bias drawn at random."""
    torch.manual_seed(seed)
    config = HF_CONFIGS[architecture]()
    config._attn_implementation = "eager"
    model = getattr(transformers, architecture)(config).eval()
    randomize_(model, seed)
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if "norm" in name:
            p.copy_(1.0 + 0.3 * noise)
        elif name.endswith("bias"):
            p.copy_(0.5 * noise)
        elif "embed_tokens" in name:
            p.copy_(0.5 * noise)
        else:  # [out, in]: unit-variance outputs, so attention scores are O(1)-O(10)
            p.copy_(noise * (1.5 / math.sqrt(p.shape[-1])))
