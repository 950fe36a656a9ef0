"""The server's tokenization: off the event loop, and bounded before it is complete.

The tokenizers hold the GIL while they encode (a 1 MB prompt: 0.8 s in which no other thread
runs), so a worker thread alone would not keep the event loop free. A text longer than the
context can hold in its longest tokens is refused without tokenizing it; a shorter one is
counted in slices of a few milliseconds each, between which the event loop runs, and refused as
soon as the count passes the context. Only a prompt that can fit is tokenized whole (the slices'
ids are not used: a cut may fall inside a token)."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvflow.engine.sampling_params import SamplingParamsError, check_text
from kvflow.tokenizer import Tokenizer

SLICE_CHARS = 8192
# A cut between slices can change the tokens on either side of it, by a few at most.
SLACK_TOKENS_PER_CUT = 8


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        longest = max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)
        self.max_chars = max_model_len * max(longest, 1)  # more characters than this cannot fit
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """The token ids of `text`, computed on the tokenizer thread; SamplingParamsError naming
        `field` if the text is not valid Unicode or cannot fit the context."""
        check_text(field, text)
        self.check_length(text, field)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._encode_bounded, text, add_special_tokens, field)

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept (a prompt's echo), on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (and `tools`, for a template that renders
        them), on the tokenizer thread."""
        for i, message in enumerate(messages):
            check_text(f"messages[{i}].content", message["content"])
        self.check_length("".join(m["content"] for m in messages), "messages")
        extra = {"tools": tools} if tools else {}
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, lambda: self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra))

    def check_length(self, text: str, field: str) -> None:
        if len(text) > self.max_chars:
            raise SamplingParamsError(field, f"has {len(text)} characters, more than the model's context of "
                                             f"{self.max_model_len} tokens can hold")

    def _encode_bounded(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        if len(text) > SLICE_CHARS:
            count = 0
            for start in range(0, len(text), SLICE_CHARS):
                count += len(self.tokenizer.encode(text[start:start + SLICE_CHARS], add_special_tokens=False))
                cuts = start // SLICE_CHARS
                if count - cuts * SLACK_TOKENS_PER_CUT > self.max_model_len:
                    raise SamplingParamsError(field, f"has more than {self.max_model_len} tokens, the model's "
                                                     f"context (max_model_len)")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
