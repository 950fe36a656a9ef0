"""What a request asks of the sampler and of the stop conditions, checked when it is made."""

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    n: int = 1                    # parallel samples of the prompt (they share its KV blocks)
    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    min_p: float = 0.0            # 0 = off
    seed: int | None = None       # None: a random seed drawn when the request is made
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)          # stop strings, not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's end tokens
    ignore_eos: bool = False
    logprobs: int | None = None   # how many top log-probabilities to return per token (<= 20)
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be non-negative (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
