"""The continuous-batching engine end to end with the embedded SmolLM2 model in float32 (its weights
dequantized to float32; test_quantized_batching.py batches the quantized ones): a batch gives what
each request gives alone (also through preemption, chunked prefill and the prefix cache), seeded
sampling does not depend on the batch, aborts and stops behave as a user expects, bad input is
refused without harming the engine, and the request metrics add up.

The reference for every batched run is the same engine serving one request at a time. A batch can
still part ways with it at a near-tie: the linear layers take a fused few-row CPU path for up to 8
rows and torch's matmul above, attention splits a lone request's keys between the threads and a
batch's not, and a recomputed or cached prefix comes from a different batch shape, so float32
summation order differs by a few ulps. same_outputs() allows that and nothing else."""

import dataclasses
import warnings

import pytest

from kvflow import LLM, SamplingParams

BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, float32
POOL_BLOCKS = 256                          # 4,096 cache slots: every test's batch fits at once
MAX_TOKENS = 32

# Float32 logits from different summation orders differ by a few 1e-5 (see test_model.py); a greedy
# choice may flip only where the top two log-probabilities are closer than this.
NEAR_TIE = 1e-3

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)

_TEXT = [
    "Lighthouses were once kept by families who lived at the foot of the tower. Every evening the "
    "keeper climbed the stairs, trimmed the wick, polished the lens and wound the clockwork that turned "
    "the light, then stayed awake through the night to make sure the beam never went out.",
    "A sourdough starter is a mixture of flour and water in which wild yeast and lactic acid bacteria "
    "live together. Fed every day, it doubles in size within a few hours, and a spoonful of it can "
    "raise a whole loaf while giving the bread its slightly sour taste.",
    "Glaciers move because ice under great pressure behaves like a very thick liquid. A valley glacier "
    "may creep forward only a few centimetres a day, yet over thousands of years it carves the wide, "
    "U-shaped valleys and sharp ridges that mark mountain ranges around the world.",
    "The first public libraries lent books for free to anyone who lived in the town. Readers signed a "
    "ledger, took one volume home for two weeks, and paid a small fine if they returned it late, a "
    "rule that many libraries still follow today.",
    "Octopuses have three hearts and blue blood. Two of the hearts pump blood through the gills, the "
    "third sends it around the body, and the copper-based protein that carries oxygen gives the blood "
    "its unusual colour.",
]

PLAIN_PROMPTS = [
    "The capital of Italy is",
    "Water boils at",
    "The three primary colours are",
    "Here is a short poem about the sea:\n",
    "def is_even(n):\n    \"\"\"Return True if n is even.\"\"\"\n",
    "Once upon a time, a young fox found a lantern in the forest and",
    _TEXT[0] + " Today",
    _TEXT[1] + "\n\nTo keep a starter healthy,",
    " ".join(_TEXT[2:4]) + "\n\nBoth of these stories",
    " ".join(_TEXT[:3]) + "\n\nQuestion: which of the three paragraphs above describes the slowest "
    "process, and why?\nAnswer:",
]
CHATS = [
    [{"role": "user", "content": "What is 7 times 8?"}],
    [{"role": "user", "content": "Name three fruits that are red."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why do cats purr?"}],
    [{"role": "user", "content": "Suggest a name for a goldfish."},
     {"role": "assistant", "content": "How about Bubbles?"},
     {"role": "user", "content": "Something more unusual, please."}],
    [{"role": "user", "content": "Summarize in one sentence:\n\n" + _TEXT[2]}],
    [{"role": "user", "content": "Give this paragraph a title:\n\n" + _TEXT[4]}],
]

SYSTEM_PROMPT = (
    "You are the help desk of the Riverside Public Library. The library opens at nine in the morning "
    "and closes at eight in the evening on weekdays, and at five on Saturdays; it is closed on Sundays. "
    "Members may borrow up to ten items for three weeks and renew them twice online. Answer politely "
    "and briefly, and suggest the front desk for anything you cannot answer."
)
LIBRARY_QUESTIONS = [
    "When do you open on Saturday?",
    "How many books can I borrow?",
    "Can I renew a book online?",
    "Are you open on Sunday?",
    "How long can I keep a DVD?",
    "Where can I print a document?",
    "Do you have a children's section?",
    "What time do you close on Tuesday?",
]


def make_llm(**options) -> LLM:
    options.setdefault("kv_cache_memory", POOL_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN)
    options.setdefault("dequantize_weights", True)
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, **options)
    # Every request fits the pool alone, so a step with requests pending must schedule one of them;
    # one that does not would leave generate() spinning forever, so fail it instead.
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def schedule_or_fail():
        plan = schedule()
        if not plan.scheduled and scheduler.has_unfinished():
            raise AssertionError(f"no progress: {len(scheduler.running)} running, {len(scheduler.waiting)} "
                                 f"waiting, allocator {llm.engine.allocator.stats()}")
        return plan

    scheduler.schedule = schedule_or_fail
    return llm


def chat_ids(llm: LLM, conversation: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(conversation))


def run_alone(llm: LLM, prompts: list, params: SamplingParams) -> list:
    return [llm.generate(prompt, params, use_tqdm=False)[0] for prompt in prompts]


def num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def same_outputs(reference: list, outputs: list, label: str) -> None:
    """Asserts that each output has the tokens, text and finish reason of its reference, except that
    a greedy sequence may leave its reference at a near-tie (the two tokens' log-probabilities in the
    reference within NEAR_TIE); it is not compared past that point. Reports how many did."""
    assert len(outputs) == len(reference)
    near_ties, mismatches = [], []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        expected, got = ref.outputs[0], out.outputs[0]
        if got.token_ids == expected.token_ids:
            if (got.text, got.finish_reason) != (expected.text, expected.finish_reason):
                mismatches.append(f"#{i}: same tokens but text/finish {got.text!r}/{got.finish_reason} "
                                  f"!= {expected.text!r}/{expected.finish_reason}")
            continue
        pos = next((j for j, (a, b) in enumerate(zip(expected.token_ids, got.token_ids)) if a != b), None)
        if pos is None:
            mismatches.append(f"#{i}: {len(got.token_ids)} tokens, the reference has {len(expected.token_ids)}")
            continue
        want, have = expected.token_ids[pos], got.token_ids[pos]
        top = expected.logprobs[pos]
        gap = abs(top[want] - top[have]) if have in top else float("inf")
        entry = f"#{i} at token {pos}: {have} instead of {want} (log-probability gap {gap:.2e})"
        (near_ties if gap <= NEAR_TIE else mismatches).append(entry)
    report = (f"{label}: {len(near_ties)} of {len(outputs)} diverged at a near-tie, "
              f"{len(mismatches)} differ otherwise")
    print(f"\n{report}" + "".join(f"\n  near-tie {e}" for e in near_ties))
    if near_ties:
        warnings.warn(report)
    assert not mismatches, report + "\n" + "\n".join(mismatches)


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llm():
    """The reference engine: a roomy pool and no prefix cache, so a request alone is computed whole."""
    return make_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached_llm():
    return make_llm(enable_prefix_caching=True)


@pytest.fixture(scope="module")
def prompts(llm):
    """Ten plain prompts (text) and six chats (token ids), 3 to 188 tokens."""
    return PLAIN_PROMPTS + [chat_ids(llm, c) for c in CHATS]


@pytest.fixture(scope="module")
def prompt_lengths(llm, prompts):
    return [len(p) if isinstance(p, list) else len(llm.tokenizer.encode(p)) for p in prompts]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return run_alone(llm, prompts, GREEDY)


@pytest.fixture(scope="module")
def batched(llm, prompts):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


# ------------------------------------------------------------------------- batching


def test_batch_gives_what_each_request_gives_alone(reference, batched, prompts, prompt_lengths):
    assert len(prompts) == 16 and min(prompt_lengths) <= 5 and 180 <= max(prompt_lengths) <= 200, prompt_lengths
    for prompt, out in zip(prompts, batched):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        if isinstance(prompt, str):
            assert out.prompt == prompt
        else:
            assert out.prompt_token_ids == prompt
    assert len({out.request_id for out in batched}) == len(batched)
    same_outputs(reference, batched, "16 prompts batched vs alone")


def test_small_kv_pool_preempts_and_still_matches(reference, prompts, prompt_lengths):
    footprints = [num_blocks(n + MAX_TOKENS) for n in prompt_lengths]
    pool = max(max(footprints), int(0.4 * sum(footprints)))
    small = make_llm(kv_cache_memory=pool * BLOCK_SIZE * KV_BYTES_PER_TOKEN)
    assert small.engine.allocator.num_blocks == pool < sum(footprints)
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    preemptions = [out.metrics.num_preemptions for out in outputs]
    print(f"\npool of {pool} blocks for {sum(footprints)} needed: {small.engine.scheduler.num_preemptions} "
          f"preemptions, per request {preemptions}")
    assert small.engine.scheduler.num_preemptions > 0 and sum(preemptions) > 0
    assert small.engine.stats()["preemptions"] == small.engine.scheduler.num_preemptions
    for out in outputs:  # a preempted request keeps the tokens it had and their times
        assert len(out.metrics.token_times) == len(out.outputs[0].token_ids) == MAX_TOKENS
    same_outputs(reference, outputs, f"16 prompts in a pool of {pool} blocks vs alone")
    assert small.engine.allocator.num_used_blocks == 0
    small.engine.allocator.check_invariants()


def test_chunked_prefill_matches(reference, prompts):
    budget = 16  # the longest prompt takes 12 steps, the others share steps with decodes
    tiny = make_llm(max_num_batched_tokens=budget, max_num_seqs=budget)
    outputs = tiny.generate(prompts, GREEDY, use_tqdm=False)
    same_outputs(reference, outputs, f"16 prompts with a {budget}-token step budget vs alone")
    assert tiny.engine.allocator.num_used_blocks == 0


# ------------------------------------------------------------------------- prefix caching


def test_prefix_cache_hits_and_matches_uncached(llm, cached_llm):
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
                     for q in LIBRARY_QUESTIONS]
    ids = [chat_ids(llm, c) for c in conversations]
    shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b)
    assert shared > 4 * BLOCK_SIZE
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    expected = run_alone(llm, ids, params)

    # The first request fills the cache; the other seven, sent together, find the shared prefix.
    first = cached_llm.chat(conversations[0], params, use_tqdm=False)
    rest = cached_llm.chat(conversations[1:], params, use_tqdm=False)
    stats = cached_llm.engine.stats()
    cached = [out.metrics.num_cached_prompt_tokens for out in rest]
    print(f"\nprefix cache: {shared} shared prompt tokens, cached per later request {cached}, stats {stats}")
    assert first[0].metrics.num_cached_prompt_tokens == 0
    assert all(n == shared // BLOCK_SIZE * BLOCK_SIZE for n in cached)
    assert stats["prefix_cache_hit_rate"] > 0
    same_outputs(expected, first + rest, "8 chats sharing a system prompt, prefix cache vs none")
    assert cached_llm.engine.allocator.num_used_blocks == 0
    cached_llm.engine.allocator.check_invariants()


def test_requests_sent_together_share_their_prefix(llm, cached_llm):
    # Blocks are cached when scheduled, so requests admitted in the same step already share the
    # system prompt: only the first computes it.
    system = "Answer in the voice of a lighthouse keeper. " + SYSTEM_PROMPT
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                     for q in LIBRARY_QUESTIONS[:4]]
    ids = [chat_ids(llm, c) for c in conversations]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    expected = run_alone(llm, ids, params)
    together = cached_llm.generate(ids, params, use_tqdm=False)
    cached = [out.metrics.num_cached_prompt_tokens for out in together]
    assert cached[0] == 0 and all(n >= 4 * BLOCK_SIZE for n in cached[1:]), cached
    same_outputs(expected, together, "4 chats sent together, sharing a new system prompt")
    assert cached_llm.engine.allocator.num_used_blocks == 0


# ------------------------------------------------------------------------- seeded sampling


def test_seeded_sampling_independent_of_batch(llm, prompts):
    target = "Once upon a time, in a kingdom made of glass,"
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone

    fillers = prompts[:3] + prompts[-3:] + prompts[5:8]  # 9 others: the decode batch exceeds 8 rows
    other = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=1.0, max_tokens=16),
             SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=24)]
    for position, count in [(0, 3), (2, 4), (4, 4), (9, 9)]:
        batch = fillers[:count]
        batch.insert(position, target)
        batch_params = [other[i % 3] for i in range(count)]
        batch_params.insert(position, params)
        outputs = llm.generate(batch, batch_params, use_tqdm=False)
        # Sampling draws from the seed and the token's index, not from the row: a flip would need
        # a draw within float32 noise (~1e-5) of a bucket edge, so the tokens must be equal.
        assert outputs[position].outputs[0].token_ids == alone, f"position {position} of {count + 1}"

    others = [llm.generate(target, SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16),
                           use_tqdm=False)[0].outputs[0].token_ids for s in (1, 2, 3)]
    assert any(tokens != alone for tokens in others)


# ------------------------------------------------------------------------- abort


def test_final_only_requests_return_one_output_when_finished(llm, prompts):
    """A final_only request is silent while it runs (a cumulative one beside it reports every
    step) and ends with the same output as the cumulative one."""
    engine = llm.engine
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine.add_request("cumulative", prompts[4], base)
    engine.add_request("final", prompts[4], dataclasses.replace(base, output_kind="final_only"))
    seen = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["cumulative"]) == 12 and [o.finished for o in seen["final"]] == [True]
    final, cumulative = seen["final"][0].outputs[0], seen["cumulative"][-1].outputs[0]
    assert final.token_ids == cumulative.token_ids and len(final.token_ids) == 12
    assert final.text == cumulative.text and final.logprobs == cumulative.logprobs
    assert final.finish_reason == "length"


def test_abort_mid_stream_frees_everything(llm, cached_llm, prompts):
    engine = cached_llm.engine
    chosen = [prompts[1], prompts[7], prompts[12], prompts[15]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(chosen):
        engine.add_request(f"r{i}", prompt, params)
    streamed = {f"r{i}": [] for i in range(len(chosen))}
    for _ in range(4):
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].delta_token_ids
    assert streamed["r1"], "r1 should be generating before the abort"
    engine.abort_request("r1")
    engine.abort_request("r1")  # twice, and an unknown id: ignored
    engine.abort_request("never-added")
    engine.add_request("late", prompts[3], params)
    engine.abort_request("late")  # aborted while still waiting

    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("r1", "late"), "an aborted request produced output"
            streamed[out.request_id] += out.outputs[0].delta_token_ids
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["r0", "r2", "r3"]
    assert engine.allocator.num_used_blocks == 0, engine.allocator.stats()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    engine.allocator.check_invariants()
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0

    survivors = [finished[f"r{i}"] for i in (0, 2, 3)]
    for out in survivors:
        assert streamed[out.request_id] == out.outputs[0].token_ids  # the deltas add up
    same_outputs(run_alone(llm, [chosen[0], chosen[2], chosen[3]], params), survivors,
                 "requests that ran beside an aborted one vs alone")

    # Abort everything mid-stream; the ids are free again afterwards.
    for i in range(3):
        engine.add_request(f"all{i}", prompts[i + 8], params)
    engine.step()
    engine.step()
    assert engine.allocator.num_used_blocks > 0
    for i in range(3):
        engine.abort_request(f"all{i}")
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()
    engine.add_request("all0", prompts[0], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


# ------------------------------------------------------------------------- stop conditions


def stream(llm: LLM, prompt, params: SamplingParams):
    """Runs one request through engine.step(); returns the final output and the text deltas."""
    llm.engine.add_request("streamed", prompt, params)
    deltas, final = [], None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    return final, deltas


def test_stop_string_cut_from_text(llm, reference, prompts):
    prompt, full = prompts[5], reference[5].outputs[0]
    tokenizer = llm.tokenizer
    ends = [len(tokenizer.decode(full.token_ids[:k + 1], skip_special_tokens=True))
            for k in range(len(full.token_ids))]
    assert ends[-1] == len(full.text)
    # A stop string that starts inside one token and ends inside a later one, found once.
    k = next(k for k in range(len(ends) // 2, len(ends) - 1)
             if ends[k + 1] - ends[k] >= 3 and ends[k] - ends[k - 1] >= 3)
    start = ends[k] - 2
    stop = full.text[start:ends[k] + 2]
    assert full.text.find(stop) == start, stop
    out, deltas = stream(llm, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     stop=[stop, "never appears"]))
    got = out.outputs[0]
    assert got.finish_reason == "stop"
    assert got.text == full.text[:start]
    assert got.token_ids == full.token_ids[:k + 2]  # up to the token that completes the stop string
    assert "".join(deltas) == got.text

    # A stop string whose first characters end the text is held back, then released at the end.
    tail = full.text[-3:] + "\u2603\u2603"
    out, deltas = stream(llm, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     stop=[tail]))
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == full.text == "".join(deltas)
    assert out.outputs[0].token_ids == full.token_ids


def test_stop_token_ids_and_max_tokens(llm, reference, prompts):
    prompt, full = prompts[6], reference[6].outputs[0]
    k = next(k for k in range(4, MAX_TOKENS) if full.token_ids[k] not in full.token_ids[:k])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              stop_token_ids=[full.token_ids[k]]), use_tqdm=False)[0]
    got = out.outputs[0]
    assert got.finish_reason == "stop" and got.token_ids == full.token_ids[:k + 1]
    # As in vLLM, the stop token ends the text before it: its own text is not returned.
    assert got.text == llm.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)
    assert full.text.startswith(got.text)

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == full.token_ids[:5]


def test_end_of_turn_token_stops_a_chat(llm):
    ids = chat_ids(llm, [{"role": "user", "content": "Reply with one word: what colour is grass?"}])
    long = llm.generate(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)[0]
    tokens = long.outputs[0].token_ids
    end = next((i for i, t in enumerate(tokens) if t in llm.tokenizer.stop_token_ids), None)
    assert end is not None, f"expected the answer to end within 48 tokens: {long.outputs[0].text!r}"
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[:end + 1]
    assert out.text == llm.tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert "<|im_end|>" not in out.text


# ------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_and_engine_keeps_serving(llm, reference, prompts):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    cases = [
        ([1] * engine.max_model_len, SamplingParams(max_tokens=1), "context"),
        ("", SamplingParams(max_tokens=4), "empty"),
        ([[]], SamplingParams(max_tokens=4), "empty"),
        ([5, vocab, 7], SamplingParams(max_tokens=4), r"prompt: must be in \[0"),
        ([5, -1], SamplingParams(max_tokens=4), r"prompt: must be in \[0"),
        # The last token sampled is never fed back: prompt + max_tokens - 1 slots must fit the pool.
        ([5, 6], SamplingParams(max_tokens=POOL_BLOCKS * BLOCK_SIZE), "KV blocks"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    engine.add_request("fits", [5, 6], SamplingParams(max_tokens=POOL_BLOCKS * BLOCK_SIZE - 1))
    engine.abort_request("fits")
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="sampling params for"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    # A batch with one bad prompt is refused whole: the good ones queued before it are withdrawn.
    with pytest.raises(ValueError, match="empty"):
        llm.generate([prompts[0], ""], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.allocator.num_used_blocks == 0

    engine.add_request("dup", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", prompts[1], GREEDY)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.request_id == "dup" and final.prompt == prompts[0]
    same_outputs(reference[:1], [final], "after a duplicate id")
    same_outputs(reference[:1], llm.generate(prompts[0], GREEDY, use_tqdm=False), "after bad input")
    assert engine.allocator.num_used_blocks == 0


# ------------------------------------------------------------------------- metrics


def test_request_metrics_add_up(batched):
    for out in batched:
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        assert len(m.token_times) == n and len(m.itls) == n - 1
        assert m.queue_time >= 0 and m.ttft > 0 and m.e2e >= m.ttft
        assert all(gap >= 0 for gap in m.itls)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == m.token_times[0]
        assert m.finished_time >= m.token_times[-1]
        assert m.tpot == pytest.approx(sum(m.itls) / (n - 1))
        assert m.num_preemptions == 0 and m.num_cached_prompt_tokens == 0
