"""Benchmarks: speed and memory sweeps (``attnzoo bench ...``)."""
