"""The HTTP front: OpenAI-compatible API, worker pool, proxying, telemetry."""
