"""VLA policies trained with flow matching on action chunks (see registry.build_policy)."""
