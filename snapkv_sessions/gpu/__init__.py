"""CUDA-only fast paths. Nothing here is imported by the CPU code paths; each module guards its imports."""
