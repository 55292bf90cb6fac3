"""Chat templates and tokenizers: turning a request into the exact token ids the engine will see."""
