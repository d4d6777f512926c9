"""LoongForge core runtime."""
