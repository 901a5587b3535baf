"""Multi-LoRA: PEFT adapters over shared base weights, batched across one step.

request.py   LoRARequest (vLLM's), and the block-hash extra key of an adapter
adapter.py   loading and validating a PEFT directory
layers.py    LoRALinear, wrapped around a built model's linears from outside
manager.py   resident slots (at most max_loras, LRU-swapped) and each step's token slots
"""

from vllm_cluster.engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from vllm_cluster.engine.lora.manager import LoRAManager
from vllm_cluster.engine.lora.request import LoRARequest, lora_extra_key

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRAManager", "LoRARequest", "load_adapter", "lora_extra_key"]
