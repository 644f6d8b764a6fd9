"""The maintained benchmarks (bench/README.md); run each from the repository root as `python -m bench.<name>`."""
