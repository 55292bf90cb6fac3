"""Benchmarks: trace replay on simulated fleets in virtual time, and peer comparisons."""
