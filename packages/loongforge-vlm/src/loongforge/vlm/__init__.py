"""LoongForge vision-language model training on megatron-core: a VLM is composed from a
registered vision encoder (``encoders``), a projector (``projectors``) and an LLM foundation from
loongforge-llm, trained by ``lf-vlm`` (``cli``, ``recipe``) on image and video conversations
(``data``), with Hugging Face conversion (``hf``) and LoRA (``lora``)."""
