"""The public API of loongforge-llm: the names other packages (loongforge-vlm ...) may import.

Import them from here or from ``loongforge.llm`` (the same objects). Every other module of
``loongforge.llm`` is private to this package and may change without notice. A name is looked
up in its module on first use, so importing this module, or ``loongforge.llm``, imports neither
torch, megatron-core nor transformers.

"""

from __future__ import annotations

import importlib

# name: (module, attribute there, what it is)
_EXPORTS: dict[str, tuple[str, str, str]] = {
    # the model
    "GPTConfig": (
        "loongforge.llm.model_config", "GPTConfig",
        "The architecture config of the GPT-style families (llama, qwen2, qwen3); its "
        "``transformer_config_kwargs()`` is the architecture part of megatron's TransformerConfig."),
    "GPT_HF_MAPPING": (
        "loongforge.llm.families.gpt_hf", "GPT_HF_MAPPING",
        "The Hugging Face mapping rules of the GPT-style families (``model.*``/``lm_head`` <-> megatron "
        "``GPTModel``), bound to a ``GPTConfig``."),
    "masked_token_loss": (
        "loongforge.llm.recipe", "masked_token_loss",
        "``(loss sum over the tokens a loss mask selects, their count)``: the token loss of a task's ``forward``, "
        "which the loop normalises over the global batch."),
    "CONFIG_DIR": (
        "loongforge.llm.shipped_configs", "CONFIG_DIR",
        "The directory of the shipped configs, a config search path: its ``model/`` group holds the model "
        "YAMLs (``defaults: [/model@_here_: qwen2_debug]`` composes one)."),
    "FusedSelfAttention": (
        "loongforge.llm.layers.self_attention", "FusedSelfAttention",
        "The fast layer's self-attention (fused RoPE from the qkv projection, SDPA core attention): THD packed "
        "rows, context parallelism, and per-token multimodal RoPE angles when ``config.mrope_section`` is set."),
    "decoder_spec": (
        "loongforge.llm.families.decoder_spec", "decoder_spec",
        "``decoder_spec(cfg, transformer_config, kernels)``: the ``transformer_layer_spec`` megatron's ``GPTModel`` "
        "of a family takes on this pipeline stage: its one-layer spec, or a hybrid family's (Qwen3.5) block of "
        "per-layer specs (Gated DeltaNet and gated attention layers)."),
    "token_mixers": (
        "loongforge.llm.families.decoder_spec", "token_mixers",
        "The module classes in the ``self_attention`` slot of a family's layers, one per kind of layer (a hybrid "
        "family's attention class and ``GatedDeltaNet``, which takes packed rows and no attention mask)."),
    "share_rope_tables": (
        "loongforge.llm.layers.self_attention", "share_rope_tables",
        "Gives every ``FusedSelfAttention`` layer of a model one RoPE cos/sin table cache, built once per forward "
        "and reused by the other layers (call it on a model built from the fast layer spec)."),
    # packed (THD) rows and context parallelism
    "pack_sequences": (
        "loongforge.llm.data.packing", "pack",
        "One THD row ``[1, T]`` of samples (``tokens``, ``labels``, ``loss_mask``) with ``cu_seqlens``, "
        "``max_seqlen`` and, with ``pad_multiple > 1`` (``2*cp``), each sample padded and ``cu_seqlens_padded``."),
    "padded_length": (
        "loongforge.llm.data.packing", "padded_length",
        "A length rounded up to a multiple (a sample's positions in a row padded for context parallelism)."),
    "packed_seq_params": (
        "loongforge.llm.data.packing", "packed_seq_params",
        "megatron-core ``PackedSeqParams`` (THD) of a ``pack_sequences`` row (None for a row without ``cu_seqlens``)."),
    "thd_zigzag_index": (
        "loongforge.llm.layers.context_parallel_attention", "thd_zigzag_index",
        "The row positions of one CP rank's tokens of a packed row (per segment its chunks ``r`` and "
        "``2*cp-1-r``: megatron's load-balanced split)."),
    # LoRA on megatron-core's tensor-parallel linear layers
    "apply_lora": (
        "loongforge.llm.lora", "apply_lora",
        "Wraps the Column/RowParallelLinear layers of a megatron module that ``lora.target_modules`` names in "
        "TP-aware ``W x + (alpha / rank) B A x`` adapters and freezes every other parameter."),
    "LORA_DEFAULT_TARGETS": (
        "loongforge.llm.lora", "DEFAULT_TARGETS",
        "The layers ``lf-llm`` adapts by default: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``."),
    "load_base_weights": (
        "loongforge.llm.lora", "load_base_weights",
        "Loads a checkpoint's weights (same model config, no adapters) into a megatron module before "
        "``apply_lora`` (``lora.base``)."),
    # chat data
    "ChatRenderer": (
        "loongforge.llm.data.chat", "ChatRenderer",
        "Renders conversations with a chat template into token ids and the assistant-token mask."),
    "parse_chat_record": (
        "loongforge.llm.data.chat", "parse_record",
        "The ``{role, content}`` messages of one OpenAI (``messages``) or ShareGPT (``conversations``) record."),
    "read_chat_template": (
        "loongforge.llm.data.sft", "read_template",
        "The text of a Jinja chat-template file, or None for None (a missing file is a ``DataError``)."),
    "load_chat_tokenizer": (
        "loongforge.llm.data.sft", "load_chat_tokenizer",
        "A ``transformers`` tokenizer from a local directory (offline; a ``DataError`` if it cannot load)."),
    "bundled_tokenizer_path": (
        "loongforge.llm.data.bundled_files", "bundled_tokenizer_path",
        "The directory of the tokenizer that ships with the package (the default tokenizer)."),
    "DataError": (
        "loongforge.llm.data.errors", "DataError",
        "The error of unusable data, tokenizers or caches; its message names the file, line or key."),
    # caches
    "save_token_arrays": (
        "loongforge.llm.data.cache", "save_token_arrays",
        "Saves token sequences and their assistant masks as ``tokens.npy``, ``assistant.npy`` and ``offsets.npy``."),
}

__all__ = sorted(_EXPORTS)
if __doc__ is not None:  # None under python -OO
    __doc__ += "\n".join(f"- ``{name}``: {line}" for name, (_, _, line) in _EXPORTS.items()) + "\n"


def __getattr__(name: str):
    try:
        module, attribute, _ = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
