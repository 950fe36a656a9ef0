"""Hugging Face model directories: config.json plus one or more *.safetensors files (sharded with
model.safetensors.index.json), memory-mapped so that each tensor is read once, straight into the
model's (merged) parameters."""

import json
import os
from collections.abc import Iterator

import torch

from kvflow.models.config import ModelConfig


def read_hf_config(directory: str) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} has no config.json")
    with open(path) as f:
        try:
            return ModelConfig.from_hf(json.load(f))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
        except KeyError as error:
            raise ValueError(f"{path} lacks the field {error}") from error


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, name) for name in names]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{index} names the shard {os.path.basename(path)}, which is missing")
        return files
    files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights (other formats are not supported)")
    return files


def safetensors_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as error:  # safetensors raises its own SafetensorError for a damaged file
            raise ValueError(f"cannot read {path} ({type(error).__name__}: {error}); is it truncated?") from error
