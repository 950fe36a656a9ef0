"""Model graphs and the architecture registry."""

from kvflow.models.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.registry import MODEL_CLASSES, model_class

__all__ = ["LlamaForCausalLM", "MODEL_CLASSES", "ModelConfig", "model_class"]
