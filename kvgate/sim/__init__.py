"""A simulated vLLM-compatible engine: real tokenizer, vLLM's block hashes and KV events, a timing model."""
