"""LoongForge LLM training."""
