"""The tool-call formats (--tool-call-parser hermes, llama3_json, mistral): what each writes is what
it parses back; text with no call, or a malformed one, stays content; streaming holds back only
what may be the start of a call; the forced-call grammar accepts exactly calls of the given
tools with arguments following their schemas (checked with xgrammar's matcher on the embedded
model's tokenizer)."""

import json

import pytest
import transformers
import xgrammar

from kvflow.entrypoints.openai.tool_calls import TOOL_CALL_FORMATS
from kvflow.loader.model_loader import resolve_model_path
from kvflow.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_what_a_format_writes_it_parses_back(name):
    fmt = TOOL_CALL_FORMATS[name]
    text = fmt.render(CALLS)
    content, calls = fmt.parse(("Let me check. " if fmt.marker_anywhere else "") + text)
    assert content == ("Let me check." if fmt.marker_anywhere else "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "C"}),
                                                                  ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("name,text", [
    ("hermes", "Just words, no call."),
    ("hermes", "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,\n</tool_call>"),
    ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),
    ("llama3_json", "The answer is {\"name\": \"x\"} maybe"),
    ("llama3_json", "{\"name\": \"add\", \"parameters\": [1]}"),
    ("mistral", "[TOOL_CALLS] not json"),
    ("mistral", "plain text"),
])
def test_text_without_a_well_formed_call_stays_content(name, text):
    assert TOOL_CALL_FORMATS[name].parse(text) == (text, [])


@pytest.mark.parametrize("name,text,end", [
    ("hermes", "Sure, one moment.", 17),
    ("hermes", "Sure <tool", 5),           # may become <tool_call>: held back
    ("hermes", "Sure <toy", 9),             # cannot: sent
    ("hermes", "Sure\n<tool_call>\n{\"na", 5),
    ("mistral", "ok [TOOL_C", 3),
    ("llama3_json", "  {\"name\"", 0),     # a call at the start: all of it held
    ("llama3_json", "<|python", 0),
    ("llama3_json", "Paris is sunny.", 15),
])
def test_streaming_holds_back_only_what_may_be_a_call(name, text, end):
    assert TOOL_CALL_FORMATS[name].content_end(text) == end


@pytest.fixture(scope="module")
def compiler():
    tokenizer = Tokenizer.from_gguf(resolve_model_path(None))
    backend = tokenizer._backend.tokenizer
    info = xgrammar.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=backend),
                                                   vocab_size=backend.get_vocab_size(), stop_token_ids=[0])
    return xgrammar.GrammarCompiler(info), backend


def accepts(compiler, grammar, text: str) -> bool:
    xgr_compiler, backend = compiler
    matcher = xgrammar.GrammarMatcher(xgr_compiler.compile_grammar(grammar))
    ids = backend.encode(text, add_special_tokens=False).ids
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(0) and matcher.is_terminated()


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_the_forced_grammar_takes_calls_of_the_tools_and_nothing_else(compiler, name):
    fmt = TOOL_CALL_FORMATS[name]
    one, two = fmt.render(CALLS[:1]), fmt.render(CALLS)
    parallel = fmt.forced_grammar(TOOLS, parallel=True)  # its JSON is laid out as json.dumps lays it out
    assert accepts(compiler, parallel, one) and accepts(compiler, parallel, two)
    assert accepts(compiler, fmt.forced_grammar(TOOLS, parallel=False), one)
    assert not accepts(compiler, fmt.forced_grammar(TOOLS, parallel=False), two)
    wrong_args = fmt.render([{"function": {"name": "add", "arguments": {"a": "one", "b": 2}}}])
    unknown = fmt.render([{"function": {"name": "delete_all", "arguments": {}}}])
    assert not accepts(compiler, parallel, wrong_args) and not accepts(compiler, parallel, unknown)
    assert not accepts(compiler, parallel, "I will not call anything.")


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_partial_calls_grow_by_prefixes_to_the_whole_calls(name):
    """Cut after every character: each call's name appears whole or not at all, its arguments
    only grow (each cut's text a prefix of the next), and at the end they are the calls' JSON."""
    fmt = TOOL_CALL_FORMATS[name]
    text = ("Let me check. " if fmt.marker_anywhere else "") + fmt.render(CALLS)
    sent = {}
    for cut in range(len(text) + 1):
        for i, call in enumerate(fmt.partial_calls(text[:cut])):
            assert call.name in (None, "get_weather", "add")
            assert call.arguments.startswith(sent.get(i, ""))
            sent[i] = call.arguments
    final = fmt.partial_calls(text)
    assert [c.complete for c in final] == [True, True]
    assert [json.loads(c.arguments) for c in final] == [{"city": "Paris", "unit": "C"}, {"a": 1, "b": 2}]
    assert fmt.partial_calls("No calls here.") == []
