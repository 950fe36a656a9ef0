"""What the engine returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter at each output token
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    # Speculative decoding, over the request's samples: steps that verified drafts, the drafts
    # proposed, and those accepted.
    num_spec_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / proposed drafts; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step emitted on average: its accepted drafts + the target's own
        token after them (vLLM's mean acceptance length); None without drafts."""
        if not self.num_spec_verifications:
            return None
        return 1 + self.num_accepted_tokens / self.num_spec_verifications

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str                        # everything generated so far (stop strings excluded)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob} (sampled + top-n)
    delta_text: str = ""             # the text this step added, for streaming
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
