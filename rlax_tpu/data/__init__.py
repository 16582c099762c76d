"""The run's data (JAX-free): datasets (JSONL / Parquet, field mapping, chat-template
rendering, the prompt mixture, the held-out overlap check) and tokenizers (Hugging Face
`tokenizer.json` with its chat template, the demo's character tokenizer), and the tool-call
formats and turn rendering of multi-turn episodes (`tool_format`)."""
