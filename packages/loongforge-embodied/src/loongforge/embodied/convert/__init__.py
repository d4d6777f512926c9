"""Weight import/export between LoongForge policies and other layouts (declarative name maps)."""
