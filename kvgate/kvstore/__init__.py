"""State that outlives a request: conversations (sessions) and, later, KV tier residency."""
