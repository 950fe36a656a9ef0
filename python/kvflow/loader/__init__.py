"""Loading a model: resolve what the user named (the embedded default, a GGUF file, a Hugging Face
directory), build the graph for its architecture, and fill it with weights."""

from kvflow.loader.model_loader import DEFAULT_MODEL, LoadedModel, load_model, resolve_model_path

__all__ = ["DEFAULT_MODEL", "LoadedModel", "load_model", "resolve_model_path"]
