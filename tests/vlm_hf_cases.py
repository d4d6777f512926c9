"""Shared pieces of the VLM-vs-transformers equivalence tests (Qwen2.5-VL, Qwen3-VL): random
weights for a tiny transformers model, the converted LoongForge model, and samples of text,
images and videos with the inputs each side takes."""

from dataclasses import dataclass, field

import torch


def randomize_(model, norm_names=("norm", "ln_q")):
    """Every weight random, norms around 1; the model in eval mode."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if any(n in name for n in norm_names) else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def load_lf_weights(module, checkpoint) -> None:
    """The model weights of a LoongForge checkpoint into a bare megatron module."""
    from loongforge.core.checkpoint import Checkpoint
    from loongforge.core.checkpoint.sharded import load_into

    ckpt = Checkpoint(checkpoint)
    objects = ckpt.objects(0)
    common = objects.get("common", {})
    state = load_into({"model": module.sharded_state_dict()}, ckpt.reader, objects.get("sharded_objects", {}),
                      {"model": common["model"]} if "model" in common else {})
    module.load_state_dict(state["model"], strict=True)


def converted_model(hf, root, world):
    """``hf`` saved, converted by ``hf_to_lf`` and loaded into our VLM: ``(ours, converted)``."""
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.hf_mapping.convert import hf_to_lf
    from loongforge.vlm.family import build_vlm

    hf.save_pretrained(root / "hf")
    done = hf_to_lf(root / "hf", root / "lf", progress=False)
    cfg = done.model_config
    tc = TransformerConfig(**cfg.foundation.transformer_config_kwargs(), mrope_section=cfg.rotary_chunks,
                           use_cpu_initialization=True, calculate_per_token_loss=True)
    ours = build_vlm(cfg, world, tc).eval()
    load_lf_weights(ours, done.path)
    return ours, done


@dataclass
class Sample:
    tokens: torch.Tensor  # [1, s]
    items: list = field(default_factory=list)  # (kind, VisionItem) in token order
    pixels: dict = field(default_factory=lambda: {"image": [], "video": []})

    def hf_inputs(self, ids: dict) -> dict:
        """transformers' keyword arguments (pixels and grids of images and videos apart)."""
        t = self.tokens
        kw = {"mm_token_type_ids": (t == ids["image_token_id"]).int() + 2 * (t == ids["video_token_id"]).int()}
        for kind in ("image", "video"):
            grids = [item.grid for k, item in self.items if k == kind]
            if grids:
                kw["pixel_values" if kind == "image" else "pixel_values_videos"] = torch.cat(self.pixels[kind])
                kw[f"{kind}_grid_thw"] = torch.tensor(grids)
        return kw

    def ours(self):
        """Our ``(pixel_values, grid_thw)``: the items in token order."""
        order = {"image": iter(self.pixels["image"]), "video": iter(self.pixels["video"])}
        return (torch.cat([next(order[k]) for k, _ in self.items]),
                torch.tensor([item.grid for _, item in self.items]))


# Samples of the Qwen3-VL layout family (text runs and images/videos as (kind, (t, h, w)) patch
# grids), for make_sample: images alone, one video, and both
QWEN3_VL_CASES = {
    "images": [5, ("image", (1, 8, 8)), 4, ("image", (1, 6, 10)), 3, ("image", (1, 4, 4)), 6],
    "video": [3, ("video", (3, 6, 8)), 7],
    "mixed": [2, ("video", (2, 4, 6)), 3, ("image", (1, 10, 6)), 5],
}


def make_sample(parts, ids: dict, patch_dim: int, merge: int = 2, text_vocab: int = 290,
                frame_text: int | None = None) -> Sample:
    """``parts``: text lengths, ("image", (t, h, w)) or ("video", (t, h, w), seconds_per_grid_t).
    Each item is wrapped in vision start/end tokens; with ``frame_text`` every frame of a video is
    (Qwen3-VL's timestamps: that many text tokens, then the frame wrapped in start/end)."""
    from loongforge.vlm.positions import VisionItem

    g = torch.Generator().manual_seed(1)
    out, ids_list = Sample(torch.empty(0)), []

    def text(n):
        return torch.randint(0, text_vocab, (n,), generator=g).tolist()

    def wrapped(kind, n):
        return [ids["vision_start_token_id"]] + [ids[f"{kind}_token_id"]] * n + [ids["vision_end_token_id"]]

    for part in parts:
        if isinstance(part, int):
            ids_list += text(part)
            continue
        kind, (t, h, w), *rest = part
        per_frame = h * w // merge ** 2
        if kind == "video" and frame_text is not None:
            for _ in range(t):
                ids_list += text(frame_text) + wrapped(kind, per_frame)
        else:
            ids_list += wrapped(kind, t * per_frame)
        out.items.append((kind, VisionItem((t, h, w), kind == "video", rest[0] if rest else 1.0)))
        out.pixels[kind].append(torch.randn(t * h * w, patch_dim, generator=g))
    out.tokens = torch.tensor([ids_list])
    return out


def logits_pair(hf, ours, sample: Sample, ids: dict, positions, **hf_kw):
    """``(transformers' logits, ours)`` for ``sample``; ``positions`` ``[3, s]`` are ours."""
    pixels, grid_thw = sample.ours()
    with torch.no_grad():
        expected = hf(input_ids=sample.tokens, **sample.hf_inputs(ids), **hf_kw).logits
        got = ours(sample.tokens, torch.as_tensor(positions)[:, None, :], None, pixel_values=pixels, grid_thw=grid_thw)
    return expected, got


def exported_files(hf, checkpoint, root):
    """Export ``checkpoint`` to ``root/exported`` and check transformers loads bitwise the weights
    of ``hf``; returns ``(the original safetensors, the exported ones)`` (single-file checkpoints)."""
    from safetensors.torch import load_file

    from loongforge.core.hf_mapping.convert import lf_to_hf

    lf_to_hf(checkpoint, root / "exported", progress=False)
    back = type(hf).from_pretrained(root / "exported").eval()
    original, exported = hf.state_dict(), back.state_dict()
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    on_disk, written = load_file(root / "hf" / "model.safetensors"), load_file(root / "exported" / "model.safetensors")
    assert sorted(on_disk) == sorted(written)
    return on_disk, written


def assert_reexport_bitwise(root, written) -> None:
    """Importing ``root/exported`` and exporting it again writes ``written`` bit for bit."""
    from safetensors.torch import load_file

    from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

    again = hf_to_lf(root / "exported", root / "reimported", progress=False)
    lf_to_hf(again.path, root / "exported_again", progress=False)
    rewritten = load_file(root / "exported_again" / "model.safetensors")
    assert sorted(rewritten) == sorted(written) and all(torch.equal(rewritten[k], written[k]) for k in written)


def assert_stray_tensor_refused(root, tmp_path, name: str) -> None:
    """The checkpoint of ``root/hf`` plus a tensor ``name`` no table maps: import names it."""
    import pytest
    from safetensors.torch import load_file, save_file

    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.hf_mapping.convert import hf_to_lf

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config.json").write_bytes((root / "hf" / "config.json").read_bytes())
    save_file({**load_file(root / "hf" / "model.safetensors"), name: torch.zeros(2)}, stray / "model.safetensors")
    with pytest.raises(MappingError, match=name.replace(".", r"\.")):
        hf_to_lf(stray, tmp_path / "lf", progress=False)
