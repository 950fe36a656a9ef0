"""The OpenAI-compatible server, started on loopback and driven by the official `openai` client
and by raw HTTP: completions and chat, streaming or not, agree with the offline engine; 32
concurrent streams all finish; bad input gets OpenAI error bodies and the server keeps serving;
the API key is enforced; a client that leaves mid-stream gets its blocks freed; a full queue
answers 503; /metrics parses and counts what was sent; SIGTERM drains and exits 0."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest
from conftest import running_server
from prometheus_client.parser import text_string_to_metric_families

from kvflow import LLM, SamplingParams
from kvflow.bench.experiments import free_port
from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.entrypoints.openai.api_server import build_app

API_KEY = "test-key"
MODEL = "smollm2-test"
MAX_MODEL_LEN = 512
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]


@pytest.fixture(scope="module")
def served():
    llm = LLM(dtype="float32", max_num_seqs=64, max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = {p: o.outputs[0] for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False))}
    app = build_app(AsyncLLMEngine(llm.engine), MODEL, api_key=API_KEY)
    with running_server(app) as url:
        yield url, llm.engine, offline


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=API_KEY, max_retries=0)


def post(url, path, body, key=API_KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(url + path, content=raw, headers=headers, timeout=60)
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def wait_idle(engine, timeout=20):
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() or engine.allocator.num_used_blocks:
        assert time.time() < deadline, f"requests still held: {engine.stats()}"
        time.sleep(0.05)


# ------------------------------------------------------------------ the openai client


def test_completion_matches_offline_engine(served, client):
    _, _, offline = served
    for prompt in PROMPTS[:2]:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert result.object == "text_completion" and result.model == MODEL
        assert result.choices[0].text == offline[prompt].text
        assert result.choices[0].finish_reason == "length"
        assert result.usage.completion_tokens == 12
        assert result.usage.prompt_tokens > 0
        assert result.usage.total_tokens == result.usage.prompt_tokens + 12


def test_streamed_completion_joins_to_the_same_text(served, client):
    _, _, offline = served
    prompt = PROMPTS[2]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == offline[prompt].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_of_several_prompts_and_samples(served, client):
    _, _, offline = served
    result = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0, n=2,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    for choice in result.choices:
        assert choice.text == offline[PROMPTS[choice.index // 2]].text
    assert result.usage.completion_tokens == 4 * 12


def test_completion_logprobs_and_echo(served, client):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3,
                                       echo=True, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.text.startswith(PROMPTS[0])
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely
    assert "".join(lp.tokens) == choice.text[len(PROMPTS[0]):]


def test_chat_streaming_and_not(served, client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_never_reach_the_client(served, client):
    _, _, offline = served
    text = offline[PROMPTS[1]].text
    stop = text[5:9]
    assert stop.strip(), "pick a stop string inside the greedy text"
    for stream in (False, True):
        result = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=stop,
                                           stream=stream)
        got = "".join(c.choices[0].text for c in result if c.choices) if stream else result.choices[0].text
        assert got == text[: text.index(stop)]


def test_models_and_health(served, client):
    url = served[0]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200


def test_32_concurrent_streams_all_finish(served):
    url, engine, _ = served

    async def one(http, i):
        body = {"model": MODEL, "prompt": f"Request {i}: tell me a story about the number {i}.", "max_tokens": 8 + i % 5,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        usage, finish = None, None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
                usage = chunk["usage"] or usage
        return finish, usage["completion_tokens"], 8 + i % 5

    async def run():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    for finish, got, want in asyncio.run(run()):
        assert finish == "length" and got == want
    wait_idle(engine)


# ------------------------------------------------------------------ structured output

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def is_person(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int


def test_response_format_json_schema_streamed_and_not(served, client):
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format,
                                           temperature=0, max_tokens=80)
    assert whole.choices[0].finish_reason == "stop" and is_person(whole.choices[0].message.content)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format,
                                            temperature=0, max_tokens=80, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 30},
                                    "vip": {"type": "boolean"}},
                     "required": ["name", "vip"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
                                           "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("content", ["Make up an order as JSON.", "An order for two keyboards, as JSON.",
                                     "Write a shipped order for a VIP customer named Ada."])
def test_json_schema_answers_validate_and_stop(served, client, content):
    """Nested objects, an array, enums, bounded numbers, required fields, patterns: each answer
    validates with jsonschema and ends with stop, not at max_tokens."""
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), ORDER)


def test_response_format_json_object(served, client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON with a name and an age."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)


def test_structured_outputs_extra_body_choice_and_regex(served, client):
    choices = ["red", "green", "blue"]
    out = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=10, temperature=1.0,
                                    n=3, seed=5, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="The year was", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch("(19|20)[0-9]{2}", out.choices[0].text) and out.choices[0].finish_reason == "stop"


def test_unconstrained_requests_beside_constrained_ones_keep_their_tokens(served):
    """Four plain completions sent at once with four held to a schema (sharing steps, float32):
    the plain ones give what the offline engine gave, token for token, and the others validate."""
    url, engine, offline = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

    async def run():
        plain = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True}) for p in PROMPTS]
        held = [client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Order {i} as JSON."}], temperature=0, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}})
            for i in range(4)]
        return await asyncio.gather(*plain, *held)

    results = asyncio.run(run())
    for prompt, result in zip(PROMPTS, results[:4]):
        assert result.choices[0].text == offline[prompt].text
    for result in results[4:]:
        jsonschema.validate(json.loads(result.choices[0].message.content), ORDER)
    wait_idle(engine)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
])
def test_bad_constraints_are_400s_naming_the_field(served, body, param):
    url, engine, _ = served
    response = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ tool calls

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names):
    assert calls and all(c.type == "function" and c.id.startswith("call_") and c.function.name in names for c in calls)
    for c in calls:
        arguments = json.loads(c.function.arguments)
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 30
        if c.function.name == "get_weather":
            assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F")
        else:
            assert set(arguments) == {"city"}


@pytest.mark.parametrize("tool_choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_follow_the_tools_schemas_streamed_and_not(served, client, tool_choice, names):
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, tool_choice=tool_choice,
                                           temperature=0, max_tokens=120)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message.tool_calls, names)
    if not isinstance(tool_choice, str):
        assert len(choice.message.tool_calls) == 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS,
                                                 tool_choice=tool_choice, temperature=0, max_tokens=120, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in content and content.strip() == ""
    streamed = {}
    for c in chunks:
        for delta in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = streamed.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = delta.id or entry["id"]
            entry["name"] = (delta.function.name if delta.function and delta.function.name else entry["name"])
            entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    # (not compared with the answer above: the prompt's blocks now come from the prefix cache, and
    # a near-tie between another call and the end may go the other way)
    assembled = [openai.types.chat.ChatCompletionMessageToolCall(
        id=e["id"], type="function", function={"name": e["name"], "arguments": e["arguments"]})
        for e in streamed.values()]
    check_calls(assembled, names)
    assert list(streamed) == list(range(len(streamed)))
    if not isinstance(tool_choice, str):
        assert len(streamed) == 1
    fragments = [d.function.arguments for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []
                 if d.function and d.function.arguments]
    assert len(fragments) > len(streamed)  # the arguments came as they were written, not in one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_auto_and_none(served, client):
    """auto: whatever the model writes, a call is returned as tool_calls and its markup never as
    content; none: the tools are not offered, the answer is text."""
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, tool_choice="auto",
                                         temperature=0, max_tokens=80).choices[0]
    assert "<tool_call>" not in (out.message.content or "")
    if out.message.tool_calls:
        assert out.finish_reason == "tool_calls"
        check_calls(out.message.tool_calls, {"get_weather", "get_time"})
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=20).choices[0]
    assert none.message.tool_calls is None and none.message.content


def test_a_conversation_with_a_tool_result_renders_it_for_a_template_without_tools(served, client):
    """SmolLM2's template has no tools branch: the tools go into the system prompt and earlier
    calls and results are written in the Hermes format, which the rendered prompt shows."""
    url, engine, _ = served
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER_TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=20).choices[0]
    assert answer.message.content
    prompt = engine.tokenizer.decode(post(url, "/tokenize", {"messages": messages}).json()["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": WEATHER_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
])
def test_bad_tool_requests_are_400s(served, body, param):
    url, engine, _ = served
    response = post(url, "/v1/chat/completions", {"messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ tokenize and detokenize


def test_tokenize_and_detokenize_round_trip(served):
    url, engine, _ = served
    tokenizer = engine.tokenizer
    text = "The capital of France is Paris."
    body = post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    assert post(url, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"] == tokenizer.decode(body["tokens"])
    messages = [{"role": "user", "content": "Hello!"}]
    chat = post(url, "/tokenize", {"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x " * (MAX_MODEL_LEN * 40)}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_bad_tokenize_requests_are_400s(served, path, body, param):
    response = post(served[0], path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


# ------------------------------------------------------------------ bad input and access


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": [1] * (MAX_MODEL_LEN + 10)}, 400, None),
    ("/v1/completions", {"prompt": [10**9]}, 400, None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, None),
])
def test_bad_requests_get_openai_errors(served, path, body, status, param):
    url, engine, _ = served
    response = post(url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
    assert not engine.has_unfinished_requests()


def test_malformed_json_and_the_server_keeps_serving(served, client):
    url, _, offline = served
    response = post(url, "/v1/completions", None, raw=b'{"prompt": "hi", ')
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].text == offline[PROMPTS[0]].text


def test_null_fields_mean_their_defaults(served, client):
    url, _, offline = served
    response = post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "top_p": None,
                                             "n": None, "presence_penalty": None, "stream": None, "echo": None,
                                             "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == offline[PROMPTS[0]].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=None, logprobs=None)
    assert chat.usage.completion_tokens <= 4


def test_a_chat_template_error_is_the_clients(served):
    url, engine, _ = served
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    try:
        response = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    finally:
        engine.tokenizer.chat_template = template
    assert response.status_code == 400
    assert "roles must alternate" in response.json()["error"]["message"]


def test_a_failed_engine_step_is_a_500_and_the_server_recovers(served, client):
    url, engine, offline = served
    execute = engine.runner.execute

    def broken(requests, block_copies=None):
        raise RuntimeError("simulated kernel failure")

    engine.runner.execute = broken
    try:
        response = post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4})
    finally:
        engine.runner.execute = execute
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error" and "simulated kernel failure" in error["message"]
    wait_idle(engine)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].text == offline[PROMPTS[0]].text


def test_api_key_is_required(served):
    url = served[0]
    for key in (None, "wrong-key"):
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})):
            response = post(url, path, body, key=key)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0).models.list()
    assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open to probes
    assert httpx.get(url + "/metrics").status_code == 200


def test_client_disconnect_mid_stream_frees_blocks(served):
    url, engine, _ = served
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as response:
        lines = response.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: "):
                received += 1
            if received == 3:
                break
        assert engine.allocator.num_used_blocks > 0, "the request should hold blocks while streaming"
    wait_idle(engine)  # the abort freed everything well before 400 tokens
    assert engine.stats()["finished_requests"]["abort"] >= 1


def test_client_gone_before_a_non_streaming_answer_frees_blocks(served):
    url, engine, _ = served
    aborted = engine.stats()["finished_requests"]["abort"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.0)
    wait_idle(engine, timeout=5)  # 400 tokens would take far longer: the request was aborted
    assert engine.stats()["finished_requests"]["abort"] == aborted + 1


def test_metrics_count_what_was_sent(served, client):
    url, engine, _ = served
    wait_idle(engine)

    def scrape():
        values = {}
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "le")}
                if sample.labels.get("model_name") == MODEL and "le" not in sample.labels:
                    values[(sample.name, tuple(sorted(labels.items())))] = sample.value
        return values

    before = scrape()
    usages = []
    for i, prompt in enumerate(PROMPTS):
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5 + i, temperature=0,
                                           extra_body={"ignore_eos": True})
        usages.append(result.usage)
    after = scrape()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert delta("kvflow:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvflow:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("kvflow:request_success_total", finished_reason="length") == len(PROMPTS)
    assert delta("kvflow:time_to_first_token_seconds_count") == len(PROMPTS)
    assert delta("kvflow:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert delta("kvflow:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert delta("kvflow:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert after[("kvflow:num_requests_running", ())] == 0
    assert after[("kvflow:kv_cache_usage_perc", ())] == 0


# ------------------------------------------------------------------ a queue of bounded length


def test_full_queue_answers_503():
    llm = LLM(dtype="float32", max_num_seqs=1, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN,
              kv_cache_memory=16 << 20)
    app = build_app(AsyncLLMEngine(llm.engine), MODEL, max_queue_len=1)
    long = {"prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True}

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            running = asyncio.ensure_future(http.post("/v1/completions", json=long))
            while not llm.engine.stats()["running"]:
                await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(http.post("/v1/completions", json=long))
            while not llm.engine.stats()["waiting"]:
                await asyncio.sleep(0.01)
            rejected = await http.post("/v1/completions", json=long)
            for task in (running, queued):
                task.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)
            return rejected

    with running_server(app) as url:
        rejected = asyncio.run(run(url))
        assert rejected.status_code == 503
        assert "queue" in rejected.json()["error"]["message"]
        wait_idle(llm.engine)
        # This pool holds fewer tokens than the context: a chat without max_tokens is still taken
        # (its answer may fill the pool) rather than refused for a length nobody asked for.
        assert llm.engine.num_kv_tokens < MAX_MODEL_LEN
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
        wait_idle(llm.engine)


# ------------------------------------------------------------------ graceful shutdown


def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvflow", "serve", "--port", str(port), "--dtype", "float32", "--kv-cache-memory",
         "128MiB", "--max-model-len", "1024", "--shutdown-timeout", "1", "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "KVFLOW_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        log = process.stdout.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert "0 KV blocks in use" in log
