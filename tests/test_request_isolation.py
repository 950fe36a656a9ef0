"""One request never hurts another. Every value a request carries is checked where it enters
(SamplingParams, the engine's add_request, the HTTP models), with an error naming the field; an
offline generate() is all or nothing; the server keeps its event loop free of large prompts,
bounds bodies, prompts and its queue, and answers every error in OpenAI's shape. Each case an
abuse run found is a regression test here; the property-based tests draw sampling parameters and
request bodies from the whole value space while a greedy float32 canary must keep its solo output."""

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
import torch
from conftest import running_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.engine.sampling_params import SamplingParamsError
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.prompt_tokenizer import SLICE_CHARS, PromptTokenizer
from kvflow.ops import apply_penalties, sample

MODEL = "smollm2-test"
API_KEY = "isolation-key"
MAX_MODEL_LEN = 48
CANARY = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROPERTY_SETTINGS = settings(derandomize=True, max_examples=200, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20, max_num_seqs=32)


@pytest.fixture(scope="module")
def canary_solo(llm):
    return llm.generate([CANARY], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_idle(engine):
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_used_blocks == 0


# ------------------------------------------------------------------ SamplingParams at the boundary

@pytest.mark.parametrize("field,value", [
    ("top_k", 2**40),              # above int32: the step's tensor conversion overflowed
    ("top_p", 1e-46),              # positive in Python, 0 in float32
    ("repetition_penalty", 1e-46),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", 1e-30),        # the logits over it overflow float32
    ("repetition_penalty", math.inf),
    ("repetition_penalty", 1.2e-38),  # normal in float32, yet a logit of 5 over it is infinite
    ("temperature", 10**400),         # an int beyond any float
    ("min_p", 1e39),
    ("seed", 2**64),
    ("seed", -1),
    ("seed", "7"),
    ("n", 2.5),
    ("n", 10**6),
    ("max_tokens", True),
    ("max_tokens", 4.0),
    ("top_k", 3.7),
    ("logprobs", 21),
    ("ignore_eos", "yes"),
    ("stop", ["\ud800"]),          # a lone surrogate
    ("stop", [""]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [2**40]),
    ("frequency_penalty", 2.5),
])
def test_sampling_params_refuse_what_the_sampler_cannot_represent(field, value):
    with pytest.raises(SamplingParamsError, match=f"^{field}: ") as raised:
        SamplingParams(**{field: value})
    assert raised.value.field == field and isinstance(raised.value, ValueError)


def test_sampling_params_keep_values_the_sampler_represents_exactly():
    p = SamplingParams(top_k=2**31 - 1, seed=2**63 - 1, temperature=1e-5, top_p=1e-30, n=128, max_tokens=1,
                       repetition_penalty=100.0, stop="x", stop_token_ids=(3, 4))
    assert (p.top_k, p.seed, p.n, p.stop, p.stop_token_ids) == (2**31 - 1, 2**63 - 1, 128, ["x"], [3, 4])


_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-1e-40, max_value=1e-40),
    st.floats(min_value=0, max_value=3), st.text(max_size=4), st.lists(st.integers(), max_size=3),
    st.lists(st.text(max_size=3), max_size=3), st.sampled_from(["\ud800", "\U0010ffff", "0", "1e-46"]),
)
_FIELDS = ["max_tokens", "n", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
           "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs",
           "skip_special_tokens"]


@PROPERTY_SETTINGS
@given(st.dictionaries(st.sampled_from(_FIELDS), _ANY_VALUE, max_size=5))
def test_accepted_sampling_params_always_run_in_the_sampler(fields):
    """Either a ValueError naming one of the given fields, or parameters that the sampling
    kernel takes in a batch beside a plain greedy row without an error."""
    try:
        p = SamplingParams(**fields)
    except SamplingParamsError as error:
        assert error.field in fields
        return
    logits = torch.randn(2, 64) * 30
    ids = torch.tensor([3, 5, 7], dtype=torch.int64)
    apply_penalties(logits, ids, torch.tensor([0, 2, 3]), ids, torch.tensor([0, 1, 3]),
                    torch.tensor([p.repetition_penalty, 1.0]), torch.tensor([p.frequency_penalty, 0.0]),
                    torch.tensor([p.presence_penalty, 0.0]))
    tokens = sample(logits.clone(),
                    torch.tensor([p.temperature, 0.0], dtype=torch.float32),
                    torch.tensor([p.top_k, 0], dtype=torch.int32),
                    torch.tensor([p.top_p, 1.0], dtype=torch.float32),
                    torch.tensor([p.min_p, 0.0], dtype=torch.float32),
                    torch.tensor([p.seed or 0, 0], dtype=torch.int64),
                    torch.tensor([0, 0], dtype=torch.int64))
    assert 0 <= int(tokens[0]) < 64 and int(tokens[1]) == int(logits[1].argmax())


# ------------------------------------------------------------------ the offline API

def test_bad_values_never_reach_the_step_of_a_good_request(llm, canary_solo):
    engine = llm.engine
    bad = SamplingParams(top_k=5)
    bad.top_k = 2**40  # changed after it was checked: the engine checks its own copy again
    with pytest.raises(SamplingParamsError, match="top_k"):
        llm.generate([CANARY, "hello"], [GREEDY, bad], use_tqdm=False)
    assert_idle(engine)
    assert llm.generate([CANARY], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == canary_solo


def test_generate_is_all_or_nothing(llm, canary_solo):
    engine = llm.engine
    with pytest.raises(SamplingParamsError, match="sampling_params"):
        llm.generate(["hello", "world"], [GREEDY, {"n": 2}], use_tqdm=False)
    assert_idle(engine)
    with pytest.raises(SamplingParamsError, match="prompt"):
        llm.generate(["hello", [1.5, 2.7]], GREEDY, use_tqdm=False)  # float ids are refused, not truncated
    assert_idle(engine)
    with pytest.raises(SamplingParamsError, match="prompt"):
        llm.generate(["hello", "bad \ud800 text"], GREEDY, use_tqdm=False)
    assert_idle(engine)
    # A failure while adding (not a ValueError) withdraws what the call had added.
    real_add = engine.add_request
    calls = []

    def failing_add(request_id, prompt, params=None, **options):
        calls.append(request_id)
        if len(calls) == 2:
            raise TypeError("injected")
        real_add(request_id, prompt, params, **options)

    engine.add_request = failing_add
    try:
        with pytest.raises(TypeError, match="injected"):
            llm.generate(["hello", "world", "again"], GREEDY, use_tqdm=False)
    finally:
        del engine.add_request
    assert_idle(engine)
    assert llm.generate([CANARY], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == canary_solo


def test_engine_add_request_checks_its_arguments(llm):
    engine = llm.engine
    for prompt, params, field in [([True, 5], GREEDY, "prompt"), ([5, 2.0], GREEDY, "prompt"), ([], GREEDY, "prompt"),
                                  ((5, 6), {"temperature": 0}, "params"), ([5], "greedy", "params"),
                                  ([5], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids")]:
        with pytest.raises(SamplingParamsError) as raised:
            engine.add_request("checked", prompt, params)
        assert raised.value.field == field
    with pytest.raises(SamplingParamsError, match="request_id"):
        engine.add_request(7, [5], GREEDY)
    assert_idle(engine)


def test_an_engine_fault_ends_the_step_and_is_counted(llm, canary_solo):
    engine = llm.engine
    failures = engine.stats()["step_failures"]
    real_execute = engine.runner.execute

    def broken(batch):
        raise RuntimeError("injected kernel fault")

    engine.runner.execute = broken
    try:
        with pytest.raises(RuntimeError, match="injected kernel fault"):
            llm.generate([CANARY, "hello"], GREEDY, use_tqdm=False)
    finally:
        engine.runner.execute = real_execute
    assert engine.stats()["step_failures"] == failures + 1
    assert_idle(engine)
    assert llm.generate([CANARY], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == canary_solo


# ------------------------------------------------------------------ the server

@pytest.fixture(scope="module")
def server(llm):
    async_engine = AsyncLLMEngine(llm.engine)
    app = build_app(async_engine, MODEL, api_key=API_KEY, max_queue_len=16, max_request_bytes=1 << 20,
                    max_prompts_per_request=8)
    with running_server(app) as url:
        yield url


def post(url, path, body=None, raw=None, key=API_KEY, timeout=60):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(url + path, content=raw, headers=headers, timeout=timeout)
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


def raw_json(body) -> bytes:
    """The body as JSON text that keeps lone surrogates as \\ud800 escapes (as a client may send)."""
    return json.dumps(body, ensure_ascii=True).encode()


def assert_openai_error(response, status, param=...):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not ...:
        assert error["param"] == param, error


def canary_body():
    return {"model": MODEL, "prompt": CANARY, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_a_bad_request_beside_a_streaming_canary(server, llm, canary_solo):
    """The abuse run's case: top_k = 2**40 used to fail the step, and the unrelated greedy stream
    beside it ended with the error."""
    results = {}

    def stream_canary():
        with httpx.stream("POST", server + "/v1/completions", json={**canary_body(), "stream": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        results["events"] = events

    thread = threading.Thread(target=stream_canary)
    thread.start()
    bad = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 8, "top_k": 2**40})
    thread.join()
    assert_openai_error(bad, 400, "top_k")
    events = results["events"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == llm.tokenizer.decode(canary_solo, skip_special_tokens=True)
    assert_idle(llm.engine)


@pytest.mark.parametrize("field,value", [("top_k", 2**40), ("top_p", 1e-46), ("repetition_penalty", 1e-46),
                                         ("seed", 2**64), ("temperature", 1e308), ("n", 0), ("max_tokens", 0),
                                         ("stop_token_ids", [1.5])])
def test_values_the_sampler_cannot_represent_get_400_naming_the_field(server, llm, field, value):
    response = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4, field: value})
    assert_openai_error(response, 400)
    assert field in response.json()["error"]["message"] or response.json()["error"]["param"] == field
    assert_idle(llm.engine)


def test_unencodable_text_is_a_client_error(server, llm):
    assert_openai_error(post(server, "/v1/completions", raw=raw_json({"prompt": "a \ud800 b", "max_tokens": 2})),
                        400, "prompt")
    chat = {"messages": [{"role": "user", "content": "hi \udfff"}], "max_tokens": 2}
    assert_openai_error(post(server, "/v1/chat/completions", raw=raw_json(chat)), 400, "messages[0].content")
    response = post(server, "/v1/completions", raw=raw_json({"prompt": "hi", "model": "m\ud800", "max_tokens": 2}))
    assert_openai_error(response, 404, "model")
    assert_idle(llm.engine)


@pytest.mark.parametrize("body,param", [
    ({"n": True}, "n"), ({"seed": "7"}, "seed"), ({"temperature": "0.5"}, "temperature"),
    ({"echo": "yes"}, "echo"), ({"max_tokens": 2.0}, "max_tokens"),
])
def test_the_http_fields_take_no_other_type(server, body, param):
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert_openai_error(response, 400, param)


def test_chat_errors_name_the_chat_fields(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}),
                        400, "top_logprobs")
    assert_openai_error(post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 0}),
                        400, "max_completion_tokens")


def test_the_key_is_checked_under_a_mount_prefix(llm):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    app = build_app(AsyncLLMEngine(llm.engine), MODEL, api_key=API_KEY)
    outer = Starlette(routes=[Mount("/api", app=app)])

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer), base_url="http://test") as client:
            return await client.post("/api/v1/completions", json={"prompt": "hi", "max_tokens": 1})

    assert_openai_error(asyncio.run(call()), 401)


def test_float_token_ids_are_refused_not_truncated(server):
    assert_openai_error(post(server, "/v1/completions", {"prompt": [1.5, 2.7], "max_tokens": 2}), 400)
    assert_openai_error(post(server, "/v1/completions", {"prompt": [[1, 2], [3.5]], "max_tokens": 2}), 400)


def test_a_huge_prompt_is_refused_without_stalling_the_server(server, llm):
    prompt = "word " * 200_000  # 1 MB: just under the body limit
    health_latencies = []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            start = time.perf_counter()
            assert httpx.get(server + "/health", timeout=30).status_code == 200
            health_latencies.append(time.perf_counter() - start)
            time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    start = time.perf_counter()
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    elapsed = time.perf_counter() - start
    done.set()
    poller.join()
    assert_openai_error(response, 400, "prompt")
    assert "context" in response.json()["error"]["message"]
    # Refused after tokenizing a few slices, never the whole megabyte (0.8 s on this machine's CPU).
    assert elapsed < 2.0, elapsed
    assert max(health_latencies) < 0.5, health_latencies
    assert_idle(llm.engine)


def test_a_long_prompt_is_counted_in_slices_and_refused_early(llm):
    tokenizer = llm.tokenizer
    bounded = PromptTokenizer(tokenizer, max_model_len=2048)
    sliced = []
    real_encode = tokenizer.encode

    def counting_encode(text, add_special_tokens=True):
        sliced.append(len(text))
        return real_encode(text, add_special_tokens)

    tokenizer.encode = counting_encode
    try:
        with pytest.raises(SamplingParamsError, match="more than 2048 tokens"):
            asyncio.run(bounded.encode("word " * 30_000))  # 150,000 characters, 30,000 tokens
        assert max(sliced) <= SLICE_CHARS and len(sliced) <= 3  # never the whole text
        fits = "word " * 1_800  # 9,000 characters: counted in slices, then tokenized whole
        sliced.clear()
        assert asyncio.run(bounded.encode(fits)) == real_encode(fits)
        assert sliced[-1] == len(fits)
    finally:
        del tokenizer.encode
        bounded.close()


def test_bodies_beyond_the_limit_get_413(server):
    big = raw_json({"prompt": "x" * (1 << 20), "max_tokens": 2})
    assert_openai_error(post(server, "/v1/completions", raw=big), 413)

    def chunks():  # no Content-Length: the limit applies as the body arrives
        for _ in range(17):
            yield b" " * (64 << 10)
        yield b"{}"

    response = httpx.post(server + "/v1/completions", content=chunks(), timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert_openai_error(response, 413)


def test_the_queue_bound_counts_prompts_and_samples(server, llm):
    many = post(server, "/v1/completions", {"prompt": ["hello"] * 9, "max_tokens": 2})
    assert_openai_error(many, 400, "prompt")  # more prompts than one request may carry
    samples = post(server, "/v1/completions", {"prompt": ["hello"] * 6, "n": 3, "max_tokens": 2})
    assert_openai_error(samples, 400)  # 18 samples can never fit a queue of 16
    assert "18 samples" in samples.json()["error"]["message"]
    assert_idle(llm.engine)

    async def burst():
        async with httpx.AsyncClient(base_url=server, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            body = {"prompt": ["hello", "world"], "n": 2, "max_tokens": 2, "ignore_eos": True}
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(24)])

    peak = [0]
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            peak[0] = max(peak[0], llm.engine.num_queued_samples)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    responses = asyncio.run(burst())
    watching.set()
    watcher.join()
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503} and 200 in statuses
    for r in responses:
        if r.status_code == 503:
            assert_openai_error(r, 503)
    assert peak[0] <= 16
    assert_idle(llm.engine)


def test_errors_come_in_openai_shape_and_the_key_comes_first(server):
    assert_openai_error(post(server, "/v1/completions", raw=b"{not json", key=None), 401)
    assert_openai_error(post(server, "/v1/completions", raw=b"\xff\xfe{}"), 400)  # not UTF-8: a parse failure
    assert_openai_error(post(server, "/v1/completions", raw=b"{not json"), 400)
    assert_openai_error(post(server, "/v1/completions", raw=b"[1, 2]"), 400)
    response = httpx.get(server + "/v1/nowhere", headers={"Authorization": f"Bearer {API_KEY}"})
    assert_openai_error(response, 404)
    response = httpx.get(server + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert_openai_error(response, 405)


_BODY_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.integers(min_value=-2, max_value=6),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=2),
    st.text(max_size=6), st.sampled_from(["\ud800", "\U0001f600", "<|im_start|>", "\x00"]),
    st.lists(st.integers(min_value=-5, max_value=60000), max_size=4), st.lists(st.text(max_size=3), max_size=3),
)
_BODY_FIELDS = ["temperature", "top_p", "top_k", "n", "seed", "max_tokens", "stop", "stop_token_ids", "min_p",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "echo", "ignore_eos",
                "prompt", "model", "stream", "user", "best_of", "skip_special_tokens"]


@pytest.fixture
def canary_loop(server, llm, canary_solo):
    """A greedy float32 canary requested again and again while a test runs: yields a function
    that stops it and returns every output it got."""
    outputs, stop = [], threading.Event()
    expected = llm.tokenizer.decode(canary_solo, skip_special_tokens=True)

    def loop():
        while not stop.is_set():
            response = post(server, "/v1/completions", canary_body())
            outputs.append((response.status_code, response.json()["choices"][0]["text"]
                            if response.status_code == 200 else response.text))

    thread = threading.Thread(target=loop)
    thread.start()

    def finish():
        stop.set()
        thread.join()
        return outputs, expected

    yield finish
    stop.set()
    thread.join()


@PROPERTY_SETTINGS
@given(st.dictionaries(st.sampled_from(_BODY_FIELDS), _BODY_VALUES, max_size=6))
def any_body_gets_an_openai_error_or_a_completion(server, fields):
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 4:
        body["n"] = 4  # keep the property fast: n samples each run max_tokens steps
    response = post(server, "/v1/completions", raw=raw_json(body))
    assert response.status_code in (200, 400, 404, 503), response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)
        return
    if body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
        return
    payload = response.json()
    assert payload["object"] == "text_completion" and payload["choices"]
    assert all(c["finish_reason"] in ("stop", "length") for c in payload["choices"])


def test_the_canary_keeps_its_solo_output_beside_any_body(canary_loop, server, llm):
    any_body_gets_an_openai_error_or_a_completion(server)
    outputs, expected = canary_loop()
    assert outputs, "the canary never completed"
    assert all(status == 200 and text == expected for status, text in outputs), outputs[:3]
    assert_idle(llm.engine)
