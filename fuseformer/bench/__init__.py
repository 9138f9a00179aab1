"""Benchmarks: our kernels side by side with the peers a user would pick, in one process and run."""
