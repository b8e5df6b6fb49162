"""Benchmarks run from the repo root: python -m benchmarks.compare, python benchmarks/bench_train.py ..."""
