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


# -- a whole checkpoint directory, as a user downloads one ------------------------------------

# Qwen's chat template, in the shape of Qwen3's: a default system message, ChatML turns, and
# the `enable_thinking` switch (an empty think block when it is false).
QWEN_CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
    "babysitting. How much did she earn? The answer is 10. #### 10",
    "You are a helpful assistant. Think step by step and put the answer after ####.",
    "system user assistant <think> </think> 0 1 2 3 4 5 6 7 8 9 + - * / = $ ?",
] * 4


def save_qwen_checkpoint(path, seed: int = 0) -> str:
    """A tiny random Qwen2 checkpoint directory laid out as Qwen2.5-Instruct's: config.json
    and model.safetensors (transformers' save_pretrained), a byte-level BPE tokenizer with
    ChatML special tokens, Qwen's chat template, and generation_config.json naming both
    <|im_end|> and <|endoftext|> as EOS (as the real one does). Returns the path."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=QWEN_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer)
    assert backend.get_vocab_size() <= VOCAB
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    model = make_hf_model("Qwen2ForCausalLM", seed)
    im_end, endoftext = (backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=True
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
