"""Speculative decoding's configuration, as vLLM spells it: a dict (or its JSON text) with the
method and its fields. `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}` proposes the tokens that followed the latest earlier occurrence of the
request's last n tokens (prompt_lookup_max >= n >= prompt_lookup_min, longest first)."""

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")

# Where a verification row costs a good part of a step (the CPU's quantized products are bound by
# arithmetic from the second row on: docs/benchmarks.md), drafts pay only at the smallest batches;
# a GPU's decode step stays bound by reading the weights for many rows more.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 2, "cuda": 64}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: the draft's checkpoint
    # No drafts in a step while more requests than this are running or waiting (vLLM's
    # speculative_disable_by_batch_size); None: kvflow's default for the device (DEFAULT_DISABLE_BY_BATCH_SIZE).
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """The config from a SpeculativeConfig, a dict or JSON text; None for None. ValueError
        naming the field for anything else."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method: one of {', '.join(METHODS)}")
        fields = dict(value)
        if fields["method"] == "ngram" and ("prompt_lookup_max" in fields) != ("prompt_lookup_min" in fields):
            given = fields.get("prompt_lookup_max", fields.get("prompt_lookup_min"))  # vLLM: one given sets both
            fields.setdefault("prompt_lookup_max", given)
            fields.setdefault("prompt_lookup_min", given)
        return cls(**fields)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or isinstance(self.disable_by_batch_size, bool)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got "
                             f"{self.disable_by_batch_size!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be at most 16, got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs a model (the draft's checkpoint)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method ngram takes no model")
