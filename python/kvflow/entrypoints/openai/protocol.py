"""The OpenAI request bodies kvflow accepts, as pydantic models, and their translation into
SamplingParams. Field names, defaults and ranges follow OpenAI's API reference; the vLLM extras
(top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens) sit beside them."""

from typing import Literal

from pydantic import BaseModel, Field

from kvflow.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1)            # 0 or -1: off
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return SamplingParams(
            max_tokens=max_tokens, n=self.n, temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
            min_p=self.min_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, each text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def check_supported(self) -> None:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")


class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The error object OpenAI's API returns."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
