"""LoongForge embodied package (skeleton: not built yet)."""
