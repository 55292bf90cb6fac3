"""kvgate: a session-aware gateway for LLM agents in front of vLLM/SGLang fleets."""

__version__ = "0.1.0"
