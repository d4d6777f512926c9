"""Weight import/export between LoongForge policies and other layouts (tables of the core mapping engine,
``loongforge.core.hf_mapping``)."""
