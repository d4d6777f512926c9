"""LoongForge kernels package (skeleton: not built yet)."""
