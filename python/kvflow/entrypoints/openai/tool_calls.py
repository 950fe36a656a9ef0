"""Tool calling in the chat API: the formats in which models write tool calls (vLLM's
--tool-call-parser names: hermes, llama3_json, mistral), how each is parsed out of the output, the
grammar that forces calls when tool_choice asks for them, and the prompt that describes the tools
to a model whose chat template has no tools branch (SmolLM2's): the Hermes format, documented in
docs/structured_output.md."""

import json
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(value, arguments_key: str) -> ToolCall | None:
    """A {"name": ..., arguments_key: {...}} object as a ToolCall, or None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _call_schema(tool: dict, arguments_key: str) -> dict:
    """The JSON schema of one call of `tool` (an OpenAI tool, {"type": "function", "function":
    {...}}): its name, then arguments following its parameters."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


@dataclass
class PartialCall:
    """A call as far as a streamed output has written it."""
    name: str | None  # once its name string is complete
    arguments: str    # the JSON text of its arguments so far, as the model wrote it
    complete: bool    # the arguments have closed


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i], or None where the text ends inside it."""
    if i >= len(text):
        return None
    if text[i] in "{[\"":
        depth, in_string, j = 0, False, i
        while j < len(text):
            char = text[j]
            if in_string:
                if char == "\\":
                    j += 2
                    continue
                if char == '"':
                    in_string = False
                    if depth == 0:
                        return j + 1
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \n\t\r":
        j += 1
    return j if j < len(text) else None


def _skip_blanks(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in also):
        i += 1
    return i


def _scan_call(text: str, start: int, arguments_key: str) -> tuple[PartialCall, int | None]:
    """The call object starting at text[start] ("{") as far as it is written, and where it
    ends (None while it has not)."""
    call, i = PartialCall(None, "", False), start + 1
    while True:
        i = _skip_blanks(text, i, ",")
        if i >= len(text):
            return call, None
        if text[i] == "}":
            return call, i + 1
        key_end = _value_end(text, i)
        if text[i] != '"' or key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_blanks(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call, None
        i = _skip_blanks(text, i + 1)
        end = _value_end(text, i)
        if key == arguments_key:
            call.arguments, call.complete = (text[i:], False) if end is None else (text[i:end], True)
        elif key == "name" and end is not None:
            name = json.loads(text[i:end])
            call.name = name if isinstance(name, str) else None
        if end is None:
            return call, None
        i = end


class ToolCallFormat:
    """How one family of models writes tool calls."""
    name = ""
    marker = ""             # where calls begin in the output
    marker_anywhere = True  # False: calls only at the start of the output (llama3_json)
    arguments_key = "arguments"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content before the calls, the calls); the whole text as content, and no calls,
        where it holds none this format can read."""
        raise NotImplementedError

    def render(self, calls: list[dict]) -> str:
        """An assistant message's tool_calls (OpenAI's shape) as this format writes them, for a
        chat template that has no tools branch."""
        raise NotImplementedError

    def forced_grammar(self, tools: list[dict], parallel: bool):
        """An xgrammar Grammar whose sentences are calls of `tools` in this format (one, or with
        parallel up to MAX_PARALLEL_CALLS), each call's arguments following its tool's schema."""
        raise NotImplementedError

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls a streamed output has begun, in order, each as far as it is written."""
        if self.marker_anywhere:
            at = text.find(self.marker)
            if at < 0:
                return []
            i = at + len(self.marker)
        else:
            i = _skip_blanks(text, 0)
            if text.startswith(self.marker, i):
                i += len(self.marker)
        calls = []
        while True:
            i = text.find("{", i)
            if i < 0:
                return calls
            call, end = _scan_call(text, i, self.arguments_key)
            calls.append(call)
            if end is None:
                return calls
            i = end

    def content_end(self, text: str) -> int:
        """How much of a streamed text is certainly content: up to the marker, and short of a
        tail that could still become it."""
        if not self.marker_anywhere:  # the whole output is calls, or none of it is
            stripped = text.lstrip()
            undecided = not stripped or self.marker.startswith(stripped)
            return 0 if undecided or stripped.startswith(("{", self.marker)) else len(text)
        at = text.find(self.marker)
        if at >= 0:
            return at
        for keep in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def _any_call_grammar(self, tools: list[dict], schema_of=lambda calls: calls):
        """The grammar of one call of any of `tools` as this format's JSON (schema_of wraps the
        calls' anyOf schema, for a format that writes calls in an array)."""
        import xgrammar

        calls = {"anyOf": [_call_schema(t, self.arguments_key) for t in tools]}
        return xgrammar.Grammar.from_json_schema(json.dumps(schema_of(calls)), any_whitespace=False)


MAX_PARALLEL_CALLS = 4


def _one_or_more(one, separator: str, parallel: bool):
    """The grammar `one`, or with parallel 1 to MAX_PARALLEL_CALLS of it joined by separator."""
    import xgrammar

    choices = [one]
    for _ in range(1, MAX_PARALLEL_CALLS if parallel else 1):
        choices.append(xgrammar.Grammar.concat(choices[-1], xgrammar.Grammar.from_ebnf(f'root ::= "{separator}"'), one))
    return choices[0] if len(choices) == 1 else xgrammar.Grammar.union(*choices)


class HermesFormat(ToolCallFormat):
    """<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block a call (Hermes,
    Qwen2.5 and 3, and kvflow's prompt for templates without tools)."""
    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text):
        at = text.find(self.marker)
        if at < 0:
            return text, []
        calls, rest = [], text[at:]
        while rest.startswith(self.marker):
            end = rest.find(self.end_marker)
            body = rest[len(self.marker):end if end >= 0 else len(rest)]
            try:
                call = _call_of(json.loads(body), self.arguments_key)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
            rest = "" if end < 0 else rest[end + len(self.end_marker):].lstrip()
        return text[:at].rstrip(), calls

    def render(self, calls):
        return "\n".join(f"{self.marker}\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": _arguments(c)}, ensure_ascii=False)
                         + f"\n{self.end_marker}" for c in calls)

    def forced_grammar(self, tools, parallel):
        import xgrammar

        one = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(f'root ::= "{self.marker}\\n"'),
                                      self._any_call_grammar(tools),
                                      xgrammar.Grammar.from_ebnf(f'root ::= "\\n{self.end_marker}"'))
        return _one_or_more(one, "\\n", parallel)


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1-3.3's JSON calls: the output is {"name": ..., "parameters": {...}} (after an
    optional <|python_tag|>), several separated by "; "."""
    name = "llama3_json"
    marker = "<|python_tag|>"
    marker_anywhere = False
    arguments_key = "parameters"

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker):].strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(value, self.arguments_key)
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in "; \n\t":
                position += 1
        return "", calls

    def render(self, calls):
        return "; ".join(json.dumps({"name": c["function"]["name"], "parameters": _arguments(c)}, ensure_ascii=False)
                         for c in calls)

    def forced_grammar(self, tools, parallel):
        return _one_or_more(self._any_call_grammar(tools), "; ", parallel)


class MistralFormat(ToolCallFormat):
    """Mistral's [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]."""
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse(self, text):
        at = text.find(self.marker)
        if at < 0:
            return text, []
        try:
            value, _ = json.JSONDecoder().raw_decode(text[at + len(self.marker):].lstrip())
        except json.JSONDecodeError:
            return text, []
        values = value if isinstance(value, list) else [value]
        calls = [_call_of(v, self.arguments_key) for v in values]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].rstrip(), calls

    def render(self, calls):
        return self.marker + json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls],
                                        ensure_ascii=False)

    def forced_grammar(self, tools, parallel):
        import xgrammar

        def array(calls):
            return {"type": "array", "items": calls, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}

        return xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(f'root ::= "{self.marker}"'),
                                       self._any_call_grammar(tools, array))


TOOL_CALL_FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}


def _arguments(call: dict):
    """A tool call's arguments as an object (OpenAI sends them as JSON text)."""
    arguments = call["function"].get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def tools_system_prompt(tools: list[dict]) -> str:
    """The Hermes-style description of the tools, for a chat template with no tools branch."""
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
            "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
            "about what values to plug into functions.\n<tools>\n" + described + "\n</tools>\nFor each function "
            "call, return a json object with the function name and arguments within <tool_call></tool_call> XML "
            "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
