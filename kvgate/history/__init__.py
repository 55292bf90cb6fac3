"""Canonical conversation history per model protocol: pure, no I/O."""
