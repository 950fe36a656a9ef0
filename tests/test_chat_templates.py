"""The chat templates that the families kvflow serves ship with (as llama.cpp tests them,
tests/data/llama_cpp/templates), rendered by kvflow's sandbox against transformers' own renderer:
plain turns, a system prompt, tool definitions, tool calls and tool results, with and without the
generation prompt."""

import copy
import lzma
import shutil
from pathlib import Path

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from kvflow.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "llama_cpp"

# template -> the special tokens its tokenizer config gives it
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("<|endoftext|>", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("<|endoftext|>", "<|im_end|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "ibm-granite-granite-3.3-2B-Instruct": ("<|end_of_text|>", "<|end_of_text|>"),
    "HuggingFaceTB-SmolLM3-3B": ("<|im_start|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"id": "call0abc1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "one turn": ([{"role": "user", "content": "What is the capital of France?"}], None),
    "system and turns": (
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Italy?"},
        ],
        None,
    ),
    "turns": (
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Italy?"},
        ],
        None,
    ),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL]),
    "tool call and result": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call0abc1", "name": "get_weather", "content": "18 C, sunny"},
        ],
        [WEATHER_TOOL],
    ),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "ggml-vocab-llama-spm.gguf"
    with lzma.open(DATA / "vocab" / "ggml-vocab-llama-spm.gguf.xz") as packed, open(path, "wb") as out:
        shutil.copyfileobj(packed, out)
    return Tokenizer.from_gguf(path)


def render_with_transformers(template, messages, tools, add_generation_prompt, special_tokens):
    bos, eos = special_tokens
    rendered, _ = render_jinja_template([copy.deepcopy(messages)], tools=copy.deepcopy(tools), chat_template=template,
                                        add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)
    return rendered[0]


# Tool-use-only templates (Hermes) iterate over the tools and are rendered only with them.
CASES = [(name, conversation) for name in TEMPLATES for conversation, (_, tools) in CONVERSATIONS.items()
         if tools is not None or not name.endswith("tool_use")]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("name", "conversation"), CASES)
def test_template_renders_as_transformers(tokenizer, name, conversation, add_generation_prompt):
    template = (DATA / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
    messages, tools = CONVERSATIONS[conversation]
    bos, eos = TEMPLATES[name]
    ours = copy.copy(tokenizer)
    ours.chat_template = template
    kwargs = {"bos_token": bos, "eos_token": eos}
    if tools is not None:
        kwargs["tools"] = copy.deepcopy(tools)
    try:
        expected = render_with_transformers(template, messages, tools, add_generation_prompt, TEMPLATES[name])
    except jinja2.exceptions.TemplateError as refusal:  # e.g. Gemma 2 has no system role
        with pytest.raises(jinja2.exceptions.TemplateError, match=str(refusal)[:40]):
            ours.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, **kwargs)
        return
    got = ours.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, **kwargs)
    assert got == expected
    assert messages[-1]["content"].split()[-1] in got or conversation == "tool call and result"


def test_templates_cover_tools_and_refusals(tokenizer):
    """The comparison above is only worth something if the templates really render the tools and
    the tool results, and if a refusal is a refusal: check both on known cases."""
    qwen = (DATA / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    ours = copy.copy(tokenizer)
    ours.chat_template = qwen
    messages, tools = CONVERSATIONS["tool call and result"]
    text = ours.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools), bos_token="", eos_token="")
    assert '"name": "get_weather"' in text and "<tool_call>" in text and "18 C, sunny" in text
    assert text.endswith("<|im_start|>assistant\n")
    ours.chat_template = (DATA / "templates" / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8")
    with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
        ours.apply_chat_template(copy.deepcopy(CONVERSATIONS["system and turns"][0]), bos_token="<bos>")
