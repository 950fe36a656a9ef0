"""The prompts a serving benchmark sends: random token sequences of chosen lengths, or prompts
read from a JSONL file."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.tokenizer import Tokenizer

# Decoding random ids and encoding the text again rarely gives back the same count at the first
# try (merges across the joins); a few corrections settle it.
_MAX_LENGTH_CORRECTIONS = 10


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` as the server's tokenizer counts them
    output_len: int  # the max_tokens asked for


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of `model`: None or the default's name for the embedded default, else a GGUF
    file or a Hugging Face directory."""
    from kvflow.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return Tokenizer.from_pretrained(path)
    return Tokenizer.from_gguf(path)


def _sample_lengths(rng: np.random.Generator, num: int, mean: int, range_ratio: float) -> list[int]:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high, size=num, endpoint=True).tolist()


def _prompt_of_length(tokenizer: Tokenizer, target_len: int, ordinary_ids: np.ndarray,
                      rng: np.random.Generator) -> tuple[str, int]:
    """Text of random ordinary tokens that encodes to `target_len` tokens (the special tokens the
    tokenizer adds included), and its true length should the corrections not reach the target."""
    added_tokens = len(tokenizer.encode("")) - len(tokenizer.encode("", add_special_tokens=False))
    body = rng.choice(ordinary_ids, size=max(1, target_len - added_tokens)).tolist()
    for _ in range(_MAX_LENGTH_CORRECTIONS):
        text = tokenizer.decode(body)
        length = len(tokenizer.encode(text))
        if length == target_len:
            break
        body = tokenizer.encode(text, add_special_tokens=False)
        if length > target_len:
            body = body[: max(1, len(body) - (length - target_len))]
        else:
            body = body + rng.choice(ordinary_ids, size=target_len - length).tolist()
    return text, length


def random_requests(tokenizer: Tokenizer, num: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """`num` prompts of random vocabulary tokens. Input and output lengths are drawn uniformly
    from [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("the number of prompts, the input length and the output length must be positive")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"the range ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    special = np.fromiter(tokenizer.special_token_ids, dtype=np.int64)
    ordinary_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), special)
    input_lens = _sample_lengths(rng, num, input_len, range_ratio)
    output_lens = _sample_lengths(rng, num, output_len, range_ratio)
    requests = []
    for target_len, max_tokens in zip(input_lens, output_lens):
        prompt, prompt_len = _prompt_of_length(tokenizer, target_len, ordinary_ids, rng)
        requests.append(BenchRequest(prompt, prompt_len, max_tokens))
    return requests


def jsonl_requests(path: str | Path, tokenizer: Tokenizer, num: int | None,
                   output_len: int) -> list[BenchRequest]:
    """The first `num` prompts (all when None) of a file with one JSON object per line:
    {"prompt": ..., "output_len" or "max_tokens": ...}; without a length, `output_len`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    requests = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if num is not None and len(requests) == num:
                break
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                raise ValueError(f"{path}:{line_number}: expected an object with a string \"prompt\"")
            max_tokens = entry.get("output_len", entry.get("max_tokens", output_len))
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{path}:{line_number}: the output length must be a positive integer")
            prompt = entry["prompt"]
            requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt)), max_tokens))
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    if num is not None and len(requests) < num:
        raise ValueError(f"{path} holds {len(requests)} prompts, fewer than the {num} asked for")
    return requests
