"""Completions and chat completions: an OpenAI request becomes one engine request per prompt, and
the engine's step outputs become either one response body or a stream of server-sent events."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import jinja2

from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.engine.outputs import CompletionOutput, RequestOutput
from kvflow.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from kvflow.entrypoints.openai.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvflow.entrypoints.openai.prompt_tokenizer import PromptTokenizer
from kvflow.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                               DetokenizeRequest, TokenizeRequest, error_body)
from kvflow.entrypoints.openai.tool_calls import TOOL_CALL_FORMATS, new_call_id, tools_system_prompt


class QueueFullError(Exception):
    """The waiting queue is at --max-queue-len: the server answers 503."""



@dataclass
class _Choice:
    """What has been sent of one choice so far."""
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    content_sent: int = 0  # with tools: the characters sent as content (the rest may be a call)
    calls_sent: list = field(default_factory=list)  # with tools: [id, argument characters sent] per call


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_queue_len: int | None = None,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST, tool_call_parser: str = "hermes"):
        """max_queue_len: samples (prompts x n) waiting at most, beyond which requests get 503.
        tool_call_parser: the format of the model's tool calls where its chat template renders
        tools; a template without a tools branch gets the Hermes prompt and format."""
        self.engine = engine
        self.model_name = model_name
        self.max_queue_len = max_queue_len
        self.max_prompts_per_request = max_prompts_per_request
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.prompt_tokenizer = PromptTokenizer(self.tokenizer, self.max_model_len)
        self.template_renders_tools = "tools" in (self.tokenizer.chat_template or "")
        self.tool_format = TOOL_CALL_FORMATS[tool_call_parser if self.template_renders_tools else "hermes"]
        self._admitting = 0  # samples of the requests being tokenized and added

    # ------------------------------------------------------------------ entry points

    async def completions(self, request: CompletionRequest) -> dict | AsyncIterator[str]:
        request.check_supported()
        params = request.sampling_params(request.max_new_tokens, request.logprobs)
        given = request.prompts()
        if len(given) > self.max_prompts_per_request:
            raise SamplingParamsError("prompt", f"has {len(given)} prompts; this server takes at most "
                                                f"{self.max_prompts_per_request} in one request")
        with self._admission(len(given) * params.n) as release:
            prompts = [await self._prompt_ids(p) for p in given]
            request_id = f"cmpl-{uuid.uuid4().hex}"
            streams = await self._start(request_id, prompts, params, release)
        echo = [await self.prompt_tokenizer.decode(ids) for ids in prompts] if request.echo else None
        if request.streaming:
            return self._stream_completion(request_id, request, prompts, streams, echo)
        outputs = await self._collect(streams)
        choices = []
        for p, output in enumerate(outputs):
            for completion in output.outputs:
                text = (echo[p] if echo else "") + completion.text
                choices.append({"index": p * request.num_samples + completion.index, "text": text,
                                "logprobs": self._completion_logprobs(completion.token_ids, completion.logprobs,
                                                                      params.logprobs, len(echo[p]) if echo else 0),
                                "finish_reason": completion.finish_reason})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(prompts, outputs)}

    async def chat(self, request: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        tools, tool_choice = request.tool_mode()
        with self._admission(1):  # n is known once the prompt's length is
            ids = await self._chat_prompt(request, tools if tool_choice is not None else [])
        # Unset, the answer may fill the context, or the KV pool where that is smaller (so that
        # the request is not refused for a length the client never asked for).
        room = min(self.max_model_len - len(ids), self.engine.engine.num_kv_tokens - len(ids) + 1)
        max_tokens = next((m for m in (request.max_completion_tokens, request.max_tokens) if m is not None),
                          max(room, 1))
        params = request.chat_sampling_params(max_tokens)
        if tool_choice is not None and tool_choice != "auto":
            params.structured_outputs = self._forced_calls(tools, tool_choice, request, params)
        tool_format = self.tool_format if tool_choice is not None else None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with self._admission(params.n) as release:
            streams = await self._start(request_id, [ids], params, release)
        if request.streaming:
            return self._stream_chat(request_id, request, [ids], streams, tool_format)
        outputs = await self._collect(streams)
        choices = []
        for c in outputs[0].outputs:
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            calls = []
            if tool_format is not None:
                content, calls = tool_format.parse(c.text)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [call.as_openai() for call in calls]}
                finish_reason = "tool_calls"
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs),
                            "finish_reason": finish_reason})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage([ids], outputs)}

    async def tokenize(self, request: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the ids a prompt or a conversation gives (and their token strings)."""
        request.check_form()
        if request.prompt is not None:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await self.prompt_tokenizer.encode(request.prompt, add_special_tokens=add_special)
        else:
            text = await self._render_chat(request.messages, request.add_generation_prompt,
                                           [t.model_dump(exclude_none=True) for t in request.tools or []])
            ids = await self.prompt_tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens),
                                                     field="messages")
        tokenizer = self.prompt_tokenizer.tokenizer
        strs = [tokenizer.id_to_token(i) for i in ids] if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids, special tokens kept."""
        vocab = self.engine.engine.model_config.vocab_size
        for i, token in enumerate(request.tokens):
            if not 0 <= token < vocab:
                raise SamplingParamsError("tokens", f"tokens[{i}] = {token} is not a token id in [0, {vocab})")
        return {"prompt": await self.prompt_tokenizer.decode(list(request.tokens))}

    def _forced_calls(self, tools: list[dict], tool_choice: str, request: ChatCompletionRequest,
                      params: SamplingParams) -> StructuredOutputsParams:
        """tool_choice "required" (one or more calls of any tool) or a function's name (one call of
        it) as the grammar the output must follow, in the model's tool-call format."""
        if params.structured_outputs is not None:
            raise SamplingParamsError("tool_choice", "a forced tool call cannot be combined with response_format "
                                                     "or structured_outputs")
        if tool_choice == "required":
            grammar = self.tool_format.forced_grammar(tools, parallel=request.parallel_tool_calls is not False)
        else:
            grammar = self.tool_format.forced_grammar([t for t in tools if t["function"]["name"] == tool_choice],
                                                      parallel=False)
        return StructuredOutputsParams(grammar=grammar)

    async def _chat_prompt(self, request: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """The conversation's prompt as token ids, rendered and tokenized on the tokenizer thread."""
        text = await self._render_chat(request.messages, request.add_generation_prompt, tools)
        return await self.prompt_tokenizer.encode(text, add_special_tokens=False, field="messages")

    async def _render_chat(self, chat: list[ChatMessage], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        """The chat template applied to the messages (and tools). With a template that does not
        render tools, the Hermes tool prompt joins the system message, and earlier calls and
        results are written in the Hermes format."""
        history_format = None if self.template_renders_tools else self.tool_format
        messages = [m.as_template_message(history_format) for m in chat]
        if tools and not self.template_renders_tools:
            if messages[0]["role"] == "system":
                messages[0]["content"] = messages[0]["content"] + "\n\n" + tools_system_prompt(tools)
            else:
                messages.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
        try:
            return await self.prompt_tokenizer.render_chat(messages, add_generation_prompt,
                                                           tools if self.template_renders_tools else None)
        except jinja2.TemplateError as error:  # the template's own checks, e.g. "roles must alternate"
            raise ValueError(f"the chat template rejected the messages: {error}") from error

    # ------------------------------------------------------------------ engine requests

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self.prompt_tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.engine.engine.check_num_prompt_ids(len(prompt))  # so the engine thread checks at most a context of ids
        return list(prompt)

    @contextmanager
    def _admission(self, samples: int):
        """Holds room in the waiting queue for a request of `samples` prompts x n while it is
        tokenized and added: 400 if it could never fit, 503 if the queue is full now."""
        if self.max_queue_len is not None:
            if samples > self.max_queue_len:
                raise ValueError(f"the request asks for {samples} samples (prompts x n); this server queues at "
                                 f"most {self.max_queue_len}")
            waiting = self.engine.engine.num_queued_samples + self._admitting
            if waiting + samples > self.max_queue_len:
                raise QueueFullError(f"the server's waiting queue is full ({waiting} of {self.max_queue_len} "
                                     f"samples waiting); retry later")
        held = samples

        def release(count: int) -> None:  # these samples are in the engine's queue now
            nonlocal held
            held -= count
            self._admitting -= count

        self._admitting += samples
        try:
            yield release
        finally:
            self._admitting -= held

    async def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams, release) -> list:
        """Adds one engine request per prompt (all or none) and returns their output streams;
        release(n) is called as each is added."""
        streams = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", ids, params))
                release(params.n)
        except BaseException:
            self._abort_streams(streams)
            raise
        return streams

    @staticmethod
    def _abort_streams(streams: list) -> None:
        """Ends the engine requests behind `streams` that are still running (a no-op for the
        finished ones), without awaiting: this runs in cleanup that may itself be cancelled."""
        for stream in streams:
            stream.abort_nowait()

    async def _collect(self, streams: list) -> list[RequestOutput]:
        """The final output of every stream. Cancelling (the client went away) aborts them all."""
        async def last(stream):
            final = None
            async for output in stream:
                final = output
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            self._abort_streams(streams)

    @staticmethod
    async def _merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come; closing it aborts the rest."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index, stream):
            try:
                async for output in stream:
                    await queue.put((index, output))
                await queue.put(done)
            except BaseException as error:
                await queue.put(error)

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            OpenAIServing._abort_streams(streams)

    # ------------------------------------------------------------------ streams

    async def _stream_completion(self, request_id: str, request: CompletionRequest, prompts: list[list[int]],
                                 streams: list, echo: list[str] | None) -> AsyncIterator[str]:
        created, n = int(time.time()), request.num_samples
        sent = {(p, i): _Choice() for p in range(len(prompts)) for i in range(n)}
        finals: dict[int, RequestOutput] = {}

        def chunk(choices, usage=None):
            return sse({"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": choices, "usage": usage})

        try:
            if echo:
                for p, text in enumerate(echo):
                    yield chunk([{"index": p * n + i, "text": text, "logprobs": None, "finish_reason": None}
                                 for i in range(n)])
            async for p, output in self._merged(streams):
                finals[p] = output
                for completion in output.outputs:
                    state = sent[(p, completion.index)]
                    delta = self._delta(state, completion)
                    if delta is None:
                        continue
                    text, token_ids, logprobs = delta
                    offset = len(echo[p]) if echo else 0
                    yield chunk([{"index": p * n + completion.index, "text": text,
                                  "logprobs": self._completion_logprobs(token_ids, logprobs, request.logprobs,
                                                                        offset + len(state.text) - len(text)),
                                  "finish_reason": state.finish_reason}])
            if request.include_usage:
                yield chunk([], self._usage(prompts, [finals[p] for p in range(len(prompts))]))
            yield sse("[DONE]")
        except Exception as error:  # a failed engine step: tell the client in the stream
            yield sse(error_body(str(error), "internal_error", code=500))
            yield sse("[DONE]")

    async def _stream_chat(self, request_id: str, request: ChatCompletionRequest, prompts: list[list[int]],
                           streams: list, tool_format=None) -> AsyncIterator[str]:
        created = int(time.time())
        sent = {i: _Choice() for i in range(request.num_samples)}
        num_top = request.requested_logprobs()
        final = None

        def chunk(choices, usage=None):
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": self.model_name, "choices": choices, "usage": usage})

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(request.num_samples)])
            async for _, output in self._merged(streams):
                final = output
                for completion in output.outputs:
                    state = sent[completion.index]
                    delta = self._delta(state, completion)
                    if delta is None:
                        continue
                    text, token_ids, logprobs = delta
                    if tool_format is not None:
                        for choice in self._tool_deltas(state, completion.text, tool_format, token_ids, logprobs,
                                                        num_top, completion.index):
                            yield chunk([choice])
                        continue
                    yield chunk([{"index": completion.index, "delta": {"content": text} if text else {},
                                  "logprobs": self._chat_logprobs(token_ids, logprobs, num_top),
                                  "finish_reason": state.finish_reason}])
            if request.include_usage:
                yield chunk([], self._usage(prompts, [final]))
            yield sse("[DONE]")
        except Exception as error:
            yield sse(error_body(str(error), "internal_error", code=500))
            yield sse("[DONE]")

    def _tool_deltas(self, state: "_Choice", text: str, tool_format, token_ids, logprobs, num_top: int, index: int):
        """A chat choice's chunks when tools are on: content as far as it cannot be the start of a
        call (the markup is never sent as content); each call as OpenAI's tool_calls deltas once
        its name is written (its index, id, type and name), then its arguments' JSON text as it
        grows; at the end finish_reason tool_calls, or, where the output held no call, the rest
        of it as content."""
        finished = state.finish_reason is not None
        content = text[:tool_format.content_end(text)]
        if finished:
            parsed_content, calls = tool_format.parse(text)
            if calls:
                content = parsed_content
            elif not state.calls_sent:
                content = text
        if len(content) > state.content_sent:
            yield {"index": index, "delta": {"content": content[state.content_sent:]},
                   "logprobs": self._chat_logprobs(token_ids, logprobs, num_top), "finish_reason": None}
            state.content_sent = len(content)
        for i, call in enumerate(tool_format.partial_calls(text)):
            if call.name is None:
                break
            if i == len(state.calls_sent):
                state.calls_sent.append([new_call_id(), 0])
                yield {"index": index, "delta": {"tool_calls": [{
                    "index": i, "id": state.calls_sent[i][0], "type": "function",
                    "function": {"name": call.name, "arguments": ""}}]}, "logprobs": None, "finish_reason": None}
            sent = state.calls_sent[i][1]
            if len(call.arguments) > sent:
                yield {"index": index, "delta": {"tool_calls": [{"index": i, "function": {
                    "arguments": call.arguments[sent:]}}]}, "logprobs": None, "finish_reason": None}
                state.calls_sent[i][1] = len(call.arguments)
        if finished:
            yield {"index": index, "delta": {}, "logprobs": None,
                   "finish_reason": "tool_calls" if state.calls_sent else state.finish_reason}

    @staticmethod
    def _delta(state: _Choice, completion: CompletionOutput):
        """What this output adds to the choice since it was last sent: (text, token ids, logprobs),
        or None when nothing changed."""
        token_ids = completion.token_ids[state.num_tokens:]
        logprobs = completion.logprobs[state.num_tokens:] if completion.logprobs is not None else None
        text = completion.text[len(state.text):]
        if not token_ids and not text and completion.finish_reason == state.finish_reason:
            return None
        state.text, state.num_tokens, state.finish_reason = completion.text, len(completion.token_ids), \
            completion.finish_reason
        return text, token_ids, logprobs

    # ------------------------------------------------------------------ response pieces

    @staticmethod
    def _usage(prompts: list[list[int]], outputs: list[RequestOutput]) -> dict:
        prompt_tokens = sum(len(ids) for ids in prompts)
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda item: -item[1])[:num_top]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                             num_top: int | None, text_offset: int) -> dict | None:
        if logprobs is None or num_top is None:
            return None
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            token = self._token_text(token_id)
            result["tokens"].append(token)
            result["token_logprobs"].append(entry[token_id])
            result["top_logprobs"].append({self._token_text(t): lp for t, lp in self._top(entry, num_top)})
            result["text_offset"].append(text_offset)
            text_offset += len(token)
        return result

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                       num_top: int | None) -> dict | None:
        if logprobs is None or num_top is None:
            return None

        def item(token_id, logprob):
            token = self._token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        return {"content": [{**item(token_id, entry[token_id]),
                             "top_logprobs": [item(t, lp) for t, lp in self._top(entry, num_top)]}
                            for token_id, entry in zip(token_ids, logprobs)]}
