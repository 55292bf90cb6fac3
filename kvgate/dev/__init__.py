"""Developer tooling: real engines (vLLM on CPU, LMCache, peer routers) for tests and benchmarks."""
