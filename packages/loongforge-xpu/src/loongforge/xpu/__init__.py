"""LoongForge xpu package (skeleton: not built yet)."""
