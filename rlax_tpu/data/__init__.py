"""The run's data (JAX-free): datasets (JSONL / Parquet, field mapping, chat-template
rendering, the prompt mixture, the held-out overlap check) and tokenizers (Hugging Face
`tokenizer.json` with its chat template, the demo's character tokenizer)."""
