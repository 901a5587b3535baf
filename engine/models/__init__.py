from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from engine.models.llama import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelArchConfig"]
