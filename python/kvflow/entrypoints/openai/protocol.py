"""The OpenAI request bodies kvflow accepts, as pydantic models, and their translation into
SamplingParams. Field names, defaults and ranges follow OpenAI's API reference; the vLLM extras
(top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens,
structured_outputs) sit beside them."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from kvflow.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams


# Strict: JSON's true is not the integer 1, and "7" is not a number, as in SamplingParams.
Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the schema is enforced either way


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or an instance of a JSON schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's structured_outputs extra body: one of json (a schema), json_object, regex, choice,
    grammar (EBNF)."""
    model_config = ConfigDict(populate_by_name=True)
    json_value: dict | str | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(BaseModel):
    # OpenAI marks most fields nullable: null means the default, as if the field were absent.
    # Types only: the ranges are SamplingParams' own checks, which name the field in the 400.
    model: str | None = None
    temperature: Number | None = None                                # default 1
    top_p: Number | None = None                                      # default 1
    n: StrictInt | None = None                                       # default 1
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None                           # default 0
    frequency_penalty: Number | None = None                          # default 0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: StrictInt | None = None                                   # 0 or -1: off
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    structured_outputs: StructuredOutputsBody | None = None
    response_format: ResponseFormat | None = None

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_constraint(self) -> StructuredOutputsParams | None:
        """response_format or structured_outputs as the engine's constraint (at most one of them)."""
        response_format = self.response_format
        if response_format is not None and response_format.type == "text":
            response_format = None
        if response_format is not None and self.structured_outputs is not None:
            raise SamplingParamsError("response_format", "give response_format or structured_outputs, not both")
        if response_format is not None:
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if response_format.json_schema is None or response_format.json_schema.json_schema is None:
                raise SamplingParamsError("response_format.json_schema", "type json_schema needs json_schema.schema")
            try:
                return StructuredOutputsParams(json=response_format.json_schema.json_schema)
            except SamplingParamsError as error:
                raise SamplingParamsError("response_format.json_schema", str(error).split(": ", 1)[1]) from None
        body = self.structured_outputs
        if body is None:
            return None
        return StructuredOutputsParams(json=body.json_value, json_object=bool(body.json_object), regex=body.regex,
                                       choice=body.choice, grammar=body.grammar)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.temperature is not None and self.temperature > 2:  # OpenAI's range, narrower than the sampler's
            raise SamplingParamsError("temperature", f"must be in [0, 2], got {self.temperature!r}")

        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            max_tokens=max_tokens, n=self.num_samples, temperature=given(self.temperature, 1.0),
            top_k=0 if self.top_k == -1 else given(self.top_k, 0), top_p=given(self.top_p, 1.0), min_p=given(self.min_p, 0.0),
            seed=self.seed, repetition_penalty=given(self.repetition_penalty, 1.0),
            frequency_penalty=given(self.frequency_penalty, 0.0), presence_penalty=given(self.presence_penalty, 0.0),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=given(self.ignore_eos, False),
            logprobs=logprobs, skip_special_tokens=given(self.skip_special_tokens, True),
            structured_outputs=self.structured_constraint())


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_prompt_shape(prompt) -> None:
    """Raises ValueError at the first element that does not fit the prompt's shape (the field's
    annotation), in one pass.
    pydantic would try each shape of the union on every element of a list and report them all:
    seconds on the event loop, and a message of megabytes, for a large list of bad ids."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and not prompt):
        return
    if not isinstance(prompt, list):
        raise ValueError(f"must be text, a list of texts, a list of token ids or a list of such lists, "
                         f"not {type(prompt).__name__}")
    if isinstance(prompt[0], str):
        element_ok, expected = (lambda p: isinstance(p, str)), "a text, as the first is"
    elif isinstance(prompt[0], list):
        element_ok, expected = (lambda p: isinstance(p, list) and all(map(_is_token_id, p))), \
            "a list of integer token ids, as the first is"
    else:
        element_ok, expected = _is_token_id, "an integer token id"
    for i, element in enumerate(prompt):
        if not element_ok(element):
            raise ValueError(f"element {i} ({type(element).__name__}) is not {expected}")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = None                              # default 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, prompt, handler):
        _check_prompt_shape(prompt)  # the whole check: the union's own pass is not needed after it
        return prompt

    @property
    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

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
        if self.best_of is not None and self.best_of != self.num_samples:
            raise ValueError("best_of other than n is not supported")


class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = "{}"


class ToolCallMessage(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None                  # a tool's result: which call it answers
    name: str | None = None

    def as_template_message(self, tool_format=None) -> dict:
        """The message as a chat template reads it. tool_format (tool_calls.ToolCallFormat): the
        template has no tools branch, so earlier calls are written into the content in that
        format and tool results wrapped in <tool_response> tags (Hermes)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        calls = [c.model_dump() for c in self.tool_calls or []]
        if tool_format is not None:
            if calls:
                message["content"] = "\n".join(filter(None, [message["content"], tool_format.render(calls)]))
            if self.role == "tool":
                message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
            return message
        if calls:
            message["tool_calls"] = calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> tuple[list[dict], str | None]:
        """(the tools as dicts, the tool_choice: "auto", "required", a function's name, or None
        when tools are off). OpenAI's default is "auto" with tools and "none" without."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t["function"]["name"] for t in tools}:
                raise SamplingParamsError("tool_choice", f"names the function {choice.function.name!r}, which is "
                                                         "not among the tools")
            return tools, choice.function.name
        if choice != "none" and not tools:
            raise SamplingParamsError("tool_choice", f"{choice!r} needs tools")
        return tools, None if choice == "none" else choice

    def chat_sampling_params(self, max_tokens: int) -> SamplingParams:
        """sampling_params(), its errors naming the chat request's own fields."""
        try:
            return self.sampling_params(max_tokens, self.requested_logprobs())
        except SamplingParamsError as error:
            names = {"logprobs": "top_logprobs",
                     "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}
            if error.field not in names:
                raise
            raise SamplingParamsError(names[error.field], str(error).split(": ", 1)[1]) from None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (the template has them)
    return_token_strs: StrictBool = False

    def check_form(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise SamplingParamsError("prompt", "give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise SamplingParamsError("messages", "must not be empty")


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text (special tokens kept)."""
    model: str | None = None
    tokens: list[StrictInt]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The error object OpenAI's API returns."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
