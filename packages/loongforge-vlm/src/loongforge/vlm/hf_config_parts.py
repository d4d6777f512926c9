"""Pieces the ``config.json`` translations of the VLM layouts (``hf``, ``hf_qwen3_vl``) share:
the language model's config through its loongforge-llm family's adapter, the vision token ids,
the checks of the vision/text pair and of a composition's fixed parts."""

from __future__ import annotations

from loongforge.core.hf_mapping import MappingError

TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
TEXT_ONLY_KEYS = ("architectures", "model_type", "transformers_version", "tie_word_embeddings")


def _adapter(family: str):
    from loongforge.core.models import get_model_spec

    return get_model_spec(family).hf_adapter


def checked_parts(hf, source: str, vision_act: str, encoder: str):
    """``(vision_config, text_config)`` of a transformers VLM config, after checking the ViT's
    activation and that the merger's output width is the language model's."""
    v, t = hf.vision_config, hf.text_config
    if v.hidden_act != vision_act:
        raise MappingError(f"{source}: vision_config.hidden_act={v.hidden_act!r}: the {encoder} uses {vision_act}")
    if v.out_hidden_size != t.hidden_size:
        raise MappingError(f"{source}: vision_config.out_hidden_size={v.out_hidden_size} != "
                           f"text_config.hidden_size={t.hidden_size}")
    return v, t


def foundation_from_hf(family: str, hf, raw: dict) -> tuple[object, list[int] | None]:
    """``(foundation config, mrope_section)`` from a VLM's ``text_config`` (as a dict) through the
    ``family`` adapter (the multimodal RoPE keys taken out of its ``rope_parameters``)."""
    raw = dict(raw)
    raw["tie_word_embeddings"] = bool(hf.tie_word_embeddings)
    rope = dict(raw.pop("rope_parameters", None) or {})
    section = rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    raw["rope_parameters"] = rope
    return _adapter(family).config_from_hf(raw), (list(section) if section else None)


def token_ids_from_hf(hf) -> dict:
    return {k: getattr(hf, k) for k in TOKEN_IDS}


def require(checks: dict, architecture: str) -> None:
    """``checks``: key -> (value, the value ``architecture`` needs); the first mismatch is an error."""
    for key, (value, needed) in checks.items():
        if value != needed:
            raise MappingError(f"{key}={value!r}: {architecture} needs {needed!r}")


def text_config_to_hf(family: str, foundation, mrope: dict) -> dict:
    """The ``text_config`` of a VLM ``config.json``: the ``family`` adapter's config of the
    foundation with the multimodal RoPE settings ``mrope`` in its ``rope_parameters`` (which keep
    the adapter's other RoPE settings, e.g. Qwen3.5's ``partial_rotary_factor``)."""
    text = _adapter(family).config_to_hf(foundation)
    for key in TEXT_ONLY_KEYS:
        text.pop(key, None)
    text["rope_parameters"] = {**(text.get("rope_parameters") or {}), "rope_type": "default",
                               "rope_theta": foundation.rotary_base, **mrope}
    return text


def token_ids_to_hf(vision) -> dict:
    return {k: getattr(vision, k) for k in TOKEN_IDS if getattr(vision, k) is not None}
