"""The Qwen-Image family: diffusers' ``QwenImageTransformer2DModel`` (a double-stream MMDiT) on
packed tokens, text-to-image flow matching through the shared task."""
