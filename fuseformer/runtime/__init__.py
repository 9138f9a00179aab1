"""Runtime services: backend choice, autotune cache, memory pools, CUDA graphs."""
