"""LoongForge vlm package (skeleton: not built yet)."""
