"""Vision encoders (Qwen2.5-VL ViT, SigLIP ViT) on megatron-core."""

from loongforge.vlm.encoders.vit import ENCODERS, QwenViT, SigLIPViT, VisionEncoder, build_encoder

__all__ = ["ENCODERS", "QwenViT", "SigLIPViT", "VisionEncoder", "build_encoder"]
