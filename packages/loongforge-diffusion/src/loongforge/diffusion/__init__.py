"""LoongForge diffusion package (skeleton: not built yet)."""
