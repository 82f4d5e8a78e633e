"""Benchmarks of the loader and the orchestration path (``make bench``; see README.md)."""
