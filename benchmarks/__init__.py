"""Benchmarks beside the library (not installed): one module per row of docs/benchmarks.md."""
