"""Qwen2.5-0.5B-Instruct, GRPO on GSM8K, on ONE GPU of 80 GB (H100 / A100-80GB): the
trainer and one inference worker share the GPU, each with its memory share
(docs/gpu_tpu_recipes.md).

  pip install -e ".[cuda]"
  rlax-tpu compile configs/qwen2_5_0_5b_gsm8k_gpu.py             # does it fit? (any host)
  rlax-tpu run configs/qwen2_5_0_5b_gsm8k_gpu.py \
      --set model.hf_checkpoint=/data/Qwen2.5-0.5B-Instruct --set data.path=gsm8k_train.jsonl \
      --set controller.eval_dataset=gsm8k_test.jsonl

The model section spells out no architecture: model.hf_checkpoint names it, and the config's
loading (rlax_tpu/config/checkpoint.py) fills it in from that directory's config.json, by
default configs/models/Qwen2.5-0.5B-Instruct/config.json (Qwen's own, without weights).

On-policy (η=1, N=0): on one GPU generation and training take turns instead of competing
for it. The local launcher gives the trainer 55% and the worker 35% of the GPU's memory
(XLA_PYTHON_CLIENT_MEM_FRACTION); the rest is for the two processes' CUDA contexts.
"""

from pathlib import Path

from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    DatasetConfig,
    Distribution,
    InferenceConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TrainerConfig,
    VerifierConfig,
    load_fragment,
)

# Lengths under Qwen2.5's tokenizer and chat template with the system prompt below. GSM8K
# questions are short word problems (a few sentences): 512 tokens are meant to hold every
# prompt (a longer one stops the run at its start, controller.overlong_prompts), 1024 a
# step-by-step solution. prompt + response <= max_seq_len: nothing generated is cut.
MAX_PROMPT_LEN = 512
MAX_NEW_TOKENS = 1024
MAX_SEQ_LEN = MAX_PROMPT_LEN + MAX_NEW_TOKENS

# Qwen2.5-Math's chain-of-thought instruction; the math verifier reads \boxed{} first.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


MODELS = Path(__file__).with_name("models")


def gsm8k() -> DatasetConfig:
    # `--set data.path=FILE` names the JSONL of GSM8K's own rows ({"question": ..., "answer":
    # "... #### 72"}; docs/datasets.md makes one), rendered by Qwen's chat template.
    return DatasetConfig(
        path="gsm8k/train.jsonl",
        verifier="math",
        prompt_field="question",
        answer_field="answer",
        system_prompt=SYSTEM_PROMPT,
    )


def get_config() -> RunConfig:
    return RunConfig(
        name="qwen2_5_0_5b_gsm8k_gpu",
        model=load_fragment(MODELS / "qwen2_5_0_5b.py", ModelConfig),
        staleness=StalenessConfig.PRESETS["on_policy"](),
        trainer=TrainerConfig(
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
            gpu="h100",  # `rlax-tpu compile` checks against 80 GB; a100-80gb is the same size
            gpu_memory_fraction=0.55,
            algorithm=AlgorithmConfig(name="grpo"),
            # 256 sequences a step in 2 updates of 128; 16 sequences a forward/backward.
            mini_batch_size=128,
            micro_batch_size=16,
            max_seq_len=MAX_SEQ_LEN,
            # Memory (docs/trainer.md, "Memory"; figures in docs/gpu_tpu_recipes.md): each
            # layer keeps only its input, one compiled layer, the 152k-vocab log-prob head
            # 2048 tokens at a time.
            remat_policy="full",
            scan_layers=True,
            logprob_chunk_size=2048,
            optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01),
        ),
        inference=InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=-1),
            gpu="h100",
            gpu_memory_fraction=0.35,
            num_workers=1,
            # The whole batch (32 prompts × 8) decodes at once.
            max_decode_slots=256,
            page_size=16,
            # 12 KiB a token (24 layers × 2 kv heads × 64 × k, v × bf16): 2 GiB hold 175k
            # tokens, twice what 256 sequences of the expected lengths hold at once (a batch
            # of long responses swaps some out, `kv_admission` on_demand). No bigger: the
            # JAX paged attention (what `auto` runs here, head_dim 64) writes the whole pool
            # out of place every prefill and decode call, two more copies in memory and
            # decode time that grows with the pool (docs/gpu_tpu_recipes.md).
            kv_cache_bytes=2 * 2**30,
            prefill_buckets=(128, 256, 512),
            prefill_batch_size=16,
            max_prompt_len=MAX_PROMPT_LEN,
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=1.0,
            # Expected lengths (assumptions, not measured here: `rlax-tpu compile`'s KV
            # capacity and the simulator's workload): prompts ~130 tokens with the
            # template, responses median 300, a few to the limit.
            prompt_tokens=Distribution(kind="lognormal", median=130, sigma=0.3),
            response_tokens=Distribution(kind="lognormal", median=300, sigma=0.5),
        ),
        verifiers=VerifierConfig(num_workers=4),
        controller=ControllerConfig(
            # GSM8K's 7,473 training problems: 32 a step, one epoch in 233 steps.
            num_steps=233,
            prompts_per_batch=32,
            samples_per_prompt=8,
            # Held out means held out: GSM8K's own test split (1,319 problems; the run stops
            # if any is a training prompt, controller.max_eval_overlap), greedy, at the
            # start and the end (docs/datasets.md makes the file).
            eval_dataset="gsm8k/test.jsonl",
            eval_size=1319,
        ),
        data=gsm8k(),
        storage=StorageConfig(run_dir="runs/qwen2_5_0_5b_gsm8k_gpu"),
    )
