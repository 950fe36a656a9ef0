"""Architecture name (config.json's "architectures", or GGUF's general.architecture) -> model class."""

from kvflow.models.gemma import GemmaForCausalLM
from kvflow.models.gemma2 import Gemma2ForCausalLM
from kvflow.models.gemma3 import Gemma3ForCausalLM
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
}

# GGUF general.architecture -> the Hugging Face name of the same graph
GGUF_ARCHITECTURES = {
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}


def model_class(architecture: str):
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported model architecture {architecture!r} (supported: {', '.join(MODEL_CLASSES)})")
    return MODEL_CLASSES[architecture]
