"""One request never hurts another. Every value a request carries is checked where it enters
(SamplingParams, the engine's add_request, the HTTP models), with an error naming the field; an
offline generate() is all or nothing; the server keeps its event loop free of large prompts,
bounds bodies, prompts and its queue, and answers every error in OpenAI's shape. Each case an
abuse run found is a regression test here; the property-based tests draw sampling parameters and
request bodies from the whole value space while a greedy float32 canary must keep its solo output
(the engine runs in batch-invariant mode, so that its tokens cannot depend on the requests that
share its steps: in the default mode they may, at a near-tie, as attention's key splits and the
products' tiles follow the batch)."""

import asyncio
import gc
import json
import math
import threading
import time

import httpx
import pytest
import torch
from conftest import forget_last_failure, running_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.engine.sampling_params import SamplingParamsError
from kvflow.engine.scheduler import SchedulerOutput
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
    forget_last_failure()
    gc.collect()  # the engines of earlier modules are gone, so the process-wide mode may change
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20, max_num_seqs=32,
               batch_invariant=True)


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
    ("output_kind", "delta"),
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
_EDGE_FLOATS = [0.0, -0.0, 1e-46, 1.2e-38, 1e-30, 1e-5, 3.4e38, 1e39, math.inf, -math.inf, math.nan]


def _weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each drawn about as often as its weight says."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


def _mostly(good, edges: list):
    """Values inside the field's range three times in four, else values at or past its limits."""
    return _weighted((3, good), (1, st.sampled_from(edges)))


def _decimal(low: float, high: float):
    return st.floats(low, high).map(lambda v: round(v, 3))


# Each field's own kind of value, from inside its range to just past its limits, so that most
# requests are accepted and reach the step; some draws are anything at all.
_FIELD_VALUES = {
    "max_tokens": _mostly(st.integers(1, 3), [0, -1, 2**31 - 1, 2**31, 2**63]),
    "n": _mostly(st.integers(1, 3), [0, 16, 17, 128, 129, 2**63, 2**64]),
    "temperature": _mostly(_decimal(0, 2), _EDGE_FLOATS),
    "top_k": _mostly(st.integers(0, 100), [-1, 2**31 - 1, 2**31, 2**40, 2**64]),
    "top_p": _mostly(_decimal(0.001, 1), _EDGE_FLOATS + [1.0000001]),
    "min_p": _mostly(_decimal(0, 1), _EDGE_FLOATS),
    "seed": _mostly(st.integers(0, 2**63 - 1), [None, -1, 2**63, 2**64, 2**80]),
    "repetition_penalty": _mostly(_decimal(0.01, 100), _EDGE_FLOATS + [0.0099, 100.01]),
    "frequency_penalty": _mostly(_decimal(-2, 2), _EDGE_FLOATS + [2.0001, -2.0001]),
    "presence_penalty": _mostly(_decimal(-2, 2), _EDGE_FLOATS + [2.0001, -2.0001]),
    "stop": _mostly(st.lists(st.text(min_size=1, max_size=3), max_size=2), ["x", [""], ["\ud800"]]),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 49151), max_size=2), [[-1], [2**40], [1.5]]),
    "ignore_eos": st.booleans(),
    "logprobs": _mostly(st.integers(0, 20), [None, -1, 21]),
    "skip_special_tokens": st.booleans(),
}


def _requests_of(field_values: dict, max_fields: int):
    """Dicts of up to max_fields of these fields, each value mostly of the field's own kind."""
    def values(names):
        return st.fixed_dictionaries({name: _weighted((9, field_values[name]), (1, _ANY_VALUE)) for name in names})
    return st.lists(st.sampled_from(sorted(field_values)), unique=True, max_size=max_fields).flatmap(values)


def run_in_the_sampler(p: SamplingParams) -> None:
    """p's penalties and sampling in one batch beside a plain greedy row, on fixed random logits."""
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 30
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


def test_accepted_sampling_params_always_run_in_the_sampler():
    """Either a ValueError naming one of the given fields, or parameters that the sampling
    kernel takes in a batch beside a plain greedy row without an error. Both outcomes must be
    common among the drawn examples, or the property tests little."""
    outcomes = {"accepted": 0, "refused": 0}

    @PROPERTY_SETTINGS
    @given(_requests_of(_FIELD_VALUES, max_fields=3))
    def accepted_or_refused_by_name(fields):
        try:
            p = SamplingParams(**fields)
        except SamplingParamsError as error:
            assert error.field in fields
            outcomes["refused"] += 1
            return
        run_in_the_sampler(p)
        outcomes["accepted"] += 1

    accepted_or_refused_by_name()
    assert outcomes["accepted"] >= 60 and outcomes["refused"] >= 40, outcomes


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

    def broken(batch, block_copies=None):
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


@pytest.mark.parametrize("field,value", [("seed", "7"), ("seed", 2**64), ("top_k", 2**40), ("temperature", math.inf),
                                         ("n", 2.5), ("stop", ["\ud800"])])
def test_the_engine_checks_its_own_copy_of_the_params(llm, field, value):
    """Parameters changed after they were checked are refused by the engine, offline and async."""
    params = SamplingParams(temperature=0, max_tokens=2)
    setattr(params, field, value)
    with pytest.raises(SamplingParamsError, match=f"^{field}: "):
        llm.engine.add_request("changed", [5, 6], params)

    async def add_async():
        async_engine = AsyncLLMEngine(llm.engine)
        try:
            await async_engine.add_request("changed-async", [5, 6], params)
        finally:
            await async_engine.shutdown()

    with pytest.raises(SamplingParamsError, match=f"^{field}: "):
        asyncio.run(add_async())
    assert_idle(llm.engine)


def test_a_failed_async_step_fails_only_its_own_requests(llm, canary_solo, caplog):
    """A kernel fault in the server's engine ends the requests of that step with the error (logged
    and counted); a request that comes after it gets its solo output, and no block is lost."""
    engine = llm.engine
    failures = engine.stats()["step_failures"]
    real_execute = engine.runner.execute
    steps = []

    def faulty_third_step(batch, block_copies=None):
        steps.append(len(batch))
        if len(steps) == 3:
            raise RuntimeError("injected kernel fault")
        return real_execute(batch, block_copies)

    async def stream(async_engine, request_id, prompt, params):
        final = None
        async for output in async_engine.generate(request_id, prompt, params):
            final = output
        return final

    async def run():
        async_engine = AsyncLLMEngine(engine)
        engine.runner.execute = faulty_third_step
        try:
            long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            victims = await asyncio.gather(*(stream(async_engine, f"victim-{i}", p, long)
                                             for i, p in enumerate(["hello", "world"])), return_exceptions=True)
            after = await stream(async_engine, "after", CANARY, GREEDY)
            return victims, after
        finally:
            engine.runner.execute = real_execute
            await async_engine.shutdown()

    with caplog.at_level("ERROR", logger="kvflow"):
        victims, after = asyncio.run(run())
    assert all(isinstance(v, Exception) and "injected kernel fault" in str(v) for v in victims), victims
    assert after.finished and after.outputs[0].token_ids == canary_solo
    assert engine.stats()["step_failures"] == failures + 1
    assert any("failed and they were aborted" in r.getMessage() for r in caplog.records)
    assert_idle(engine)


def test_a_scheduler_that_cannot_progress_ends_what_it_holds(llm):
    """Should the scheduler ever make no progress (a bug), the pending requests end with the
    error rather than wait forever while every later step fails again."""
    engine = llm.engine
    engine.add_request("stuck", [5, 6, 7], GREEDY)
    engine.scheduler.schedule = SchedulerOutput  # an empty plan
    try:
        with pytest.raises(RuntimeError, match="no progress"):
            engine.step()
    finally:
        del engine.scheduler.schedule
    assert_idle(engine)


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
    assert_openai_error(post(server, "/v1/completions", {"prompt": [1.5, 2.7], "max_tokens": 2}), 400, "prompt")
    assert_openai_error(post(server, "/v1/completions", {"prompt": [[1, 2], [3.5]], "max_tokens": 2}), 400, "prompt")


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_json_numbers_get_400_naming_the_field(server, llm, canary_solo, field, value):
    """JSON has no Infinity or NaN, yet Python's parser reads them: they must not reach a step."""
    response = post(server, "/v1/completions", raw=f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}'.encode())
    assert_openai_error(response, 400, field)
    assert post(server, "/v1/completions", canary_body()).json()["choices"][0]["text"] == \
        llm.tokenizer.decode(canary_solo, skip_special_tokens=True)
    assert_idle(llm.engine)


def test_a_token_id_prompt_is_bounded_by_its_length_first(server, llm):
    """300,000 ids are refused for their length before anyone looks at each id on the engine
    thread; with a float among them, for that element alone, in a short message (pydantic's own
    check of the prompt's union took 7 s on the event loop and answered 20 MB naming every one)."""
    for ids, message in [([5] * 300_000, "context"), ([5, 1.5] * 150_000, "element 1 (float)")]:
        start = time.perf_counter()
        response = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 2})
        elapsed = time.perf_counter() - start
        assert_openai_error(response, 400, "prompt")
        assert message in response.json()["error"]["message"] and len(response.content) < 1000
        assert elapsed < 1.0, elapsed
    with pytest.raises(SamplingParamsError, match="^prompt: has 300000 tokens"):
        llm.engine.add_request("too-long", [5, 1.5] * 150_000, GREEDY)
    assert_idle(llm.engine)


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

    threads = set()

    def counting_encode(text, add_special_tokens=True):
        sliced.append(len(text))
        threads.add(threading.current_thread().name)
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
        # Never on the event loop's thread: on the tokenizer's own worker.
        assert threads and all(name.startswith("kvflow-tokenize") for name in threads), threads
    finally:
        del tokenizer.encode
        bounded.close()


def test_the_chat_template_renders_off_the_event_loop(llm):
    tokenizer = llm.tokenizer
    bounded = PromptTokenizer(tokenizer, max_model_len=2048)
    threads = []
    real_render = tokenizer.apply_chat_template

    def recording_render(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_render(*args, **kwargs)

    tokenizer.apply_chat_template = recording_render
    try:
        messages = [{"role": "user", "content": "Hi!"}]
        assert asyncio.run(bounded.render_chat(messages, True)) == real_render(messages, add_generation_prompt=True)
        assert threads[0].startswith("kvflow-tokenize"), threads
    finally:
        del tokenizer.apply_chat_template
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
    assert set(statuses) == {200, 503}, statuses  # 96 samples at once against a queue of 16
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


_BODY_FIELD_VALUES = {
    **{name: values for name, values in _FIELD_VALUES.items() if name not in ("logprobs", "max_tokens")},
    "max_tokens": _mostly(st.integers(1, 3), [0, -1, 2**31 - 1, 2**31, 2**63]),
    "logprobs": _mostly(st.integers(0, 5), [None, -1, 6, 21]),
    "prompt": _mostly(st.text(min_size=1, max_size=8) | st.lists(st.integers(0, 49151), min_size=1, max_size=4)
                      | st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
                      ["\ud800", "<|im_start|>", "\x00", [], [1.5], [-1], [49152], [[1, 2], [3]]]),
    "model": _mostly(st.just(MODEL), ["another-model"]),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=4),
    "best_of": _mostly(st.integers(1, 2), [0, 3]),
}
_CHAT_MESSAGES = _mostly(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                    "content": st.text(max_size=8)}), min_size=1, max_size=3),
    [[], [{"role": "user"}], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 5}],
     [{"role": "user", "content": "\udfff"}], "hi"])
_CHAT_FIELD_VALUES = {
    **{name: values for name, values in _BODY_FIELD_VALUES.items()
       if name not in ("prompt", "echo", "logprobs", "best_of", "user")},
    "messages": _CHAT_MESSAGES,
    "max_completion_tokens": _mostly(st.integers(1, 3), [0, 2**31]),
    "logprobs": st.booleans(),
    "top_logprobs": _mostly(st.integers(0, 20), [-1, 21]),
}


@pytest.fixture
def canary_loop(server, llm, canary_solo):
    """A greedy float32 canary requested again and again while a test runs: yields a function
    that stops it and returns every output it got (an exception in the loop is an output too)."""
    outputs, stop = [], threading.Event()
    expected = llm.tokenizer.decode(canary_solo, skip_special_tokens=True)

    def loop():
        while not stop.is_set():
            try:
                response = post(server, "/v1/completions", canary_body())
                outputs.append((response.status_code, response.json()["choices"][0]["text"]
                                if response.status_code == 200 else response.text))
            except Exception as error:  # noqa: BLE001 - reported by the test, not swallowed
                outputs.append(("exception", repr(error)))

    thread = threading.Thread(target=loop)
    thread.start()

    def finish():
        stop.set()
        thread.join()
        return outputs, expected

    yield finish
    stop.set()
    thread.join()


def num_prompts(prompt) -> int:
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def check_completed(body: dict, response, kind: str) -> None:
    """A 200 is a whole completion: every choice ends with stop or length, and a stream ends
    with [DONE] after its chunks, none of them an error."""
    choices = num_prompts(body.get("prompt")) * body.get("n", 1)
    if body.get("stream") is True:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1:]
        finished = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
    else:
        payload = response.json()
        assert payload["object"] == kind
        finished = {c["index"]: c["finish_reason"] for c in payload["choices"]}
    assert sorted(finished) == list(range(choices)), (finished, body)
    assert set(finished.values()) <= {"stop", "length"}, finished


def any_body_gets_an_openai_error_or_a_completion(server, path, body, outcomes):
    response = post(server, path, raw=raw_json(body))
    assert response.status_code in (200, 400, 404, 503), response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)
        outcomes["refused"] += 1
        return
    check_completed(body, response, "text_completion" if path == "/v1/completions" else "chat.completion")
    outcomes["completed"] += 1


def test_the_canary_keeps_its_solo_output_beside_any_body(canary_loop, server, llm):
    """Completion and chat bodies drawn field by field, most of them valid: each gets an OpenAI
    error or a whole completion, while a greedy canary beside them keeps its solo output."""
    completions, chats = {"completed": 0, "refused": 0}, {"completed": 0, "refused": 0}

    @PROPERTY_SETTINGS
    @given(_requests_of(_BODY_FIELD_VALUES, max_fields=3))
    def completion_bodies(fields):
        any_body_gets_an_openai_error_or_a_completion(server, "/v1/completions",
                                                      {"prompt": "hi", "max_tokens": 2, **fields}, completions)

    @PROPERTY_SETTINGS
    @given(_requests_of(_CHAT_FIELD_VALUES, max_fields=3))
    def chat_bodies(fields):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
        any_body_gets_an_openai_error_or_a_completion(server, "/v1/chat/completions", body, chats)

    completion_bodies()
    chat_bodies()
    outputs, expected = canary_loop()
    assert outputs, "the canary never completed"
    wrong = [(i, output) for i, output in enumerate(outputs) if output != (200, expected)]
    assert not wrong, (f"{len(wrong)} of {len(outputs)} canary outputs differ from {expected!r}", wrong[:5])
    for outcomes in (completions, chats):  # else the properties tested little
        assert outcomes["completed"] >= 50 and outcomes["refused"] >= 40, (completions, chats)
    assert_idle(llm.engine)
