"""Load a SigLIP tower into a tensor-parallel ``siglip_vit`` encoder and record its features.

    torchrun --nproc-per-node=2 siglip_tp_probe.py HF_DIR IMAGE.pt OUT.pt

Every rank reads its TP shards of ``HF_DIR``'s tower (``encoder.init_from_hf``'s loader), runs
the ``[1, 3, H, W]`` image of ``IMAGE.pt`` (patch size 8) and rank 0 writes the features.
"""

import sys

import numpy as np
import torch
import torch.distributed as dist


def main(hf_dir: str, image_path: str, out: str) -> None:
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.vlm.data.media import PatchGeometry, patchify
    from loongforge.vlm.encoders import build_encoder
    from loongforge.vlm.encoders.layers import encoder_transformer_config
    from loongforge.vlm.encoders.siglip_vit import SigLIPViTConfig
    from loongforge.vlm.hf_siglip import load_tower

    ctx = init_parallel(tp=dist.get_world_size() if dist.is_initialized() else 2)
    tp = ctx.pgs.tp.size()
    cfg = SigLIPViTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, patch_size=8,
                          image_size=32, spatial_merge_size=1)
    foundation = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True)
    encoder = build_encoder(cfg, encoder_transformer_config(cfg, tp, "none", foundation), ctx.pgs).eval()
    load_tower(encoder, cfg, hf_dir)
    flat, grid = patchify(torch.load(image_path).numpy(), PatchGeometry(8, 1, 1))
    with torch.no_grad():
        features = encoder(torch.from_numpy(np.ascontiguousarray(flat)), torch.tensor([grid]))
    if ctx.pgs.tp.rank() == 0 and dist.get_rank() == 0:
        torch.save({"tp": tp, "features": features}, out)
    destroy_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:4])
