"""Hugging Face interop: import and export of Mixtral, Qwen3-MoE and DeepSeek-V3
checkpoints (``hf``), sparse upcycling of a dense model (``upcycle``) and generation
with a KV cache (``generate``). Needs ``safetensors``; never ``transformers``."""
