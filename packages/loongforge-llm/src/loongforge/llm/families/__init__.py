"""Model families of loongforge-llm, each registered as a ``loongforge.models`` entry point."""
