"""Hugging Face interop: import of Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints
(``hf``), export as the transformers family that represents a model exactly, Ernie 4.5
MoE and GLM-4 MoE included (``hf_export``, ``hf_families``), sparse upcycling of a dense
model (``upcycle``) and generation with a KV cache (``generate``). Needs ``safetensors``
and ``tokenizers``; never ``transformers``."""
