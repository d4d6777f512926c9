"""``lf-llm lora merge`` and the LLM's naming of ``lf-llm convert lora-to-peft``.

    lf-llm lora merge CKPT OUT             # OUT/step_00000000: the base weights with W + (alpha/r) B A
    lf-llm convert lora-to-peft CKPT OUT   # OUT/adapter_config.json + adapter_model.safetensors

A merged checkpoint is a plain checkpoint of the family (``checkpoint.load=OUT`` or
``lora.base=OUT`` trains on from it); ``lf-llm convert lf-to-hf`` (and ``train --save-hf``)
exports a LoRA checkpoint to Hugging Face merged, by the same fold. ``lora-to-peft`` is the
shared direction of every CLI (``loongforge.core.lora.export_checkpoint_adapter``): the adapters
alone under transformers' module names, which ``peft.PeftModel.from_pretrained`` loads onto the
``lf-to-hf`` export of the base model.
"""

from __future__ import annotations

ROUTED_EXPERTS = ".mlp.experts.local_experts."
ROUTED_EXPERTS_UNNAMED = ("routed MoE experts: transformers holds them as fused 3-D parameters, which PEFT's LoRA "
                          "does not adapt; leave them out of lora.target_modules, e.g. "
                          "'lora.target_modules=[linear_qkv,linear_proj,shared_experts.linear_fc1,shared_experts.linear_fc2]'")


def lora_layouts(manifest: dict, names: list[str]):
    """``convert lora-to-peft``: the adapters under the family's transformers names
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); megatron's fused
    ``linear_qkv`` and SwiGLU ``linear_fc1`` become q/k/v_proj and gate/up_proj adapters sharing
    ``A``, ``B`` split as the HF mapping splits the weight. Routed experts are refused."""
    from loongforge.core.lora import transformers_layout

    return [transformers_layout(manifest, leave_out=lambda name: ROUTED_EXPERTS in name, unnamed=ROUTED_EXPERTS_UNNAMED)]


def cmd_lora(args) -> int:
    from loongforge.core.config import ConfigError
    from loongforge.core.output_paths import check_output_path
    from loongforge.llm.lora import merge_checkpoint

    check_output_path(args.out, "lora merge OUT")  # never a run's own checkpoint root
    try:
        path = merge_checkpoint(args.checkpoint, args.out)
    except (FileExistsError, FileNotFoundError) as exc:  # an output that exists, a missing source
        raise ConfigError(str(exc)) from exc
    print(f"lf-llm: merged weights of {args.checkpoint} -> {path}")
    return 0


def add_lora_command(sub) -> None:
    lora = sub.add_parser("lora", help="merge a LoRA checkpoint's adapters into its base weights (a plain checkpoint); "
                                       "the adapters alone: `convert lora-to-peft`")
    lora.add_argument("action", choices=["merge"])
    lora.add_argument("checkpoint", help="LoRA training checkpoint (a step directory or a checkpoint root)")
    lora.add_argument("out", help="output checkpoint root (new; not inside a run's checkpoint root)")
    lora.set_defaults(fn=cmd_lora)
