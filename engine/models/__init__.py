from vllm_cluster.engine.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from vllm_cluster.engine.models.llama import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelArchConfig"]
