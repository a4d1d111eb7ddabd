"""Hugging Face interop: import of Mixtral, Qwen3-MoE, Ernie 4.5 MoE, GLM-4 MoE and
DeepSeek-V3 checkpoints (``hf``), export as the transformers family that represents a
model exactly (``hf_export``, ``hf_families``), sparse upcycling of a dense
model (``upcycle``) and generation with a KV cache (``generate``). Needs ``safetensors``
and ``tokenizers``; never ``transformers``."""
