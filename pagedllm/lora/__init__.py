"""LoRA adapters: the request type (``request.LoRARequest``, vLLM's name and place), the engine's LoRA
settings (``config.LoRAConfig``), the PEFT directory reader (``peft_reader``) and the llama.cpp LoRA
GGUF reader (``gguf_adapter``, which also picks the reader for a path).

This floor imports nothing of pagedllm: the model's adapter layers live in ``models/lora_linear.py``
and the runner's slots in ``worker/lora_slots.py``.
"""
