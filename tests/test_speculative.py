"""Speculative decoding (n-gram prompt lookup) and batch-invariant mode, on the embedded model.

Batch-invariant mode: one row's logits are bit-equal whether 1, 5, 9 or 40 rows share the
forward pass, in bfloat16 and float32, for decode rows and for the rows of a multi-token chunk.
Speculation: in that mode, greedy and seeded sampled outputs are identical with and without
drafts in float32 and bfloat16 (batched, and under preemption and chunked prefill), stop strings,
n > 1, max_tokens and log-probabilities included; afterwards every KV block is free and the prefix cache
holds no block with a rejected draft in it; the metrics count what was proposed and accepted.
Structured output: constrained requests (JSON schema, regex, choice) speculate with both
proposers and give the tokens they give without drafts; each row's mask follows the drafts before
it, as xgrammar's matcher stepped token by token gives it."""

import pytest
import torch

from kvflow import LLM, SamplingParams, platform
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.model_runner import ModelRunner
from kvflow.engine.ngram_proposer import NgramProposer
from kvflow.engine.sequence import Sequence
from kvflow.engine.speculative_config import SpeculativeConfig
from kvflow.engine.speculator import FIRST_PAUSE_STEPS, SpeculationGate

BLOCK_SIZE = 16
# Drafts at every batch size here (the CPU default stops them above 2 requests), so that
# verification rows share steps with other requests' rows.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
         "disable_by_batch_size": 64}

_TEXT = ("The first public libraries lent books for free to anyone who lived in the town. Readers signed a "
         "ledger, took one volume home for two weeks, and paid a small fine if they returned it late, a rule "
         "that many libraries still follow today.")
_CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
         "    return 2 * (width + height)\n")
CHATS = [
    [{"role": "user", "content": "Repeat this text exactly:\n\n" + _TEXT}],
    [{"role": "user", "content": "Rename area to rectangle_area and print the whole file:\n\n" + _CODE}],
    [{"role": "user", "content": "Which lines of this text mention money?\n\n" + _TEXT}],
    [{"role": "user", "content": "Name three fruits that are red."}],
]
PLAIN = ["The capital of Italy is", _TEXT + "\n\nIn short,"]

pytestmark = pytest.mark.usefixtures("batch_invariant_mode_off_after")

def make_llm(dtype: str, speculative: bool, **options) -> LLM:
    return LLM(dtype=dtype, block_size=BLOCK_SIZE, speculative_config=NGRAM if speculative else None, **options)

def prompts_of(llm: LLM) -> list[list[int]]:
    tokenizer = llm.tokenizer
    return [tokenizer.encode(tokenizer.apply_chat_template(chat)) for chat in CHATS] + \
           [tokenizer.encode(text) for text in PLAIN]

# ------------------------------------------------------------------------- batch-invariant mode

def logits_of_rows(runner: ModelRunner, query_lens: list[int], contexts: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits of every new token of a step over the runner's model, op by op: request i has
    contexts[i] tokens cached before its query_lens[i] new ones, in blocks of its own."""
    tables, first = [], 0
    for context, new in zip(contexts, query_lens):
        blocks = -(-(context + new) // BLOCK_SIZE)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(tokens, dtype=torch.int64), metadata, runner.kv_caches)
        return runner.model.compute_logits(hidden).clone()

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_rows_are_bit_equal_at_any_batch_size(dtype):
    """Request 0 (a 40-token context) and its next token, alone and beside 4, 8 and 39 other
    decode rows (contexts of 3 to 120 tokens), and as the last row of a 5-token chunk beside
    others: its logits never change by a bit."""
    llm = make_llm(dtype, False, batch_invariant=True, enforce_eager=True)
    runner = llm.engine.runner
    generator = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    context_tokens = torch.randint(0, vocab, (40 * 200,), generator=generator).tolist()
    # Fill every request's cache once: 40 requests, each its own blocks, context 40 for request 0.
    contexts = [40] + [3 + 3 * i for i in range(39)]
    logits_of_rows(runner, contexts, [0] * 40, context_tokens[:sum(contexts)])
    new = torch.randint(0, vocab, (40,), generator=generator).tolist()
    alone = logits_of_rows(runner, [1], [40], new[:1])[0]
    for rows in (5, 9, 40):
        batch = logits_of_rows(runner, [1] * rows, contexts[:rows], new[:rows])
        assert torch.equal(batch[0], alone), f"{rows} decode rows: the row's logits changed"
    # Request 0's last 5 context tokens again as one chunk (rewriting the same keys), then the row.
    chunk = context_tokens[35:40] + new[:1]
    for others in (0, 4, 35):
        batch = logits_of_rows(runner, [6] + [1] * others, [35] + contexts[1:1 + others], chunk + new[1:1 + others])
        assert torch.equal(batch[5], alone), f"a 6-row chunk beside {others} rows: the row's logits changed"

def test_batch_invariant_mode_is_process_wide_and_held():
    llm = make_llm("float32", False, batch_invariant=True)
    assert platform.batch_invariant()
    with pytest.raises(ValueError, match="process-wide"):
        make_llm("float32", False)
    del llm

# ------------------------------------------------------------------------- identical outputs

def run(llm: LLM, prompts, params) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.allocator.num_used_blocks == 0, "blocks left in use after every request finished"
    return outputs

def assert_same(reference: list, outputs: list) -> None:
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        for a, b in zip(ref.outputs, out.outputs):
            assert b.token_ids == a.token_ids, f"prompt {i} sample {a.index}: tokens differ"
            assert (b.text, b.finish_reason) == (a.text, a.finish_reason), f"prompt {i}: text or finish differs"

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_and_seeded_outputs_identical_with_and_without_drafts(dtype):
    """Batch-invariant mode: the same tokens, text and finish reasons with and without n-gram
    drafts, for greedy requests and seeded sampled ones (n = 2), with stop strings and
    log-probabilities; and the drafts were used (most accepted on the input-grounded prompts)."""
    greedy = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=7, n=2, stop=["\n\n\n"])
    plain = make_llm(dtype, False, batch_invariant=True)
    prompts = prompts_of(plain)
    reference = run(plain, prompts, greedy), run(plain, prompts, sampled)
    del plain
    llm = make_llm(dtype, True, batch_invariant=True)
    outputs = run(llm, prompts, greedy), run(llm, prompts, sampled)
    for ref, out in zip(reference, outputs):
        assert_same(ref, out)
    for ref, out in zip(reference[0], outputs[0]):
        for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    grounded = [out.metrics for out in outputs[0][:2]]
    assert all(m.num_draft_tokens > 0 and m.acceptance_rate > 0.3 for m in grounded), \
        [(m.num_draft_tokens, m.acceptance_rate) for m in grounded]
    assert all(m.mean_accepted_length > 1.5 for m in grounded)
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["accepted_per_position"][0] >= stats["accepted_per_position"][-1]
    assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]

def test_greedy_identical_under_preemption_and_chunked_prefill():
    """Float32, batch-invariant mode: greedy tokens with drafts equal those of plain decoding, in
    a KV pool so small that requests are preempted and recomputed, and with prompts prefilled in
    chunks of 32 tokens (without the mode, a recomputed or chunked prefill rounds differently)."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = make_llm("float32", False, batch_invariant=True)
    prompts = prompts_of(plain)
    reference = run(plain, prompts, greedy)
    del plain
    kv_bytes_per_token = 2 * 30 * 3 * 64 * 4
    small = make_llm("float32", True, batch_invariant=True, kv_cache_memory=24 * BLOCK_SIZE * kv_bytes_per_token,
                     max_num_batched_tokens=32, max_num_seqs=8)
    outputs = run(small, prompts, greedy)
    assert small.engine.stats()["preemptions"] > 0, "the pool was meant to preempt"
    assert small.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert_same(reference, outputs)

# ------------------------------------------------------------------------- KV cache and prefix cache

def test_prefix_cache_never_holds_a_rejected_draft():
    """Every verification's rejected draft, appended to the tokens before it, is looked up in the
    prefix cache: no block ending in it (or holding it) is ever found, while the accepted text's
    full blocks are."""
    llm = make_llm("float32", True)
    engine = llm.engine
    rejected: list[list[int]] = []
    execute = engine.runner.execute

    def recording(requests, copies=None):
        results = execute(requests, copies)
        for r, tokens in zip(requests, results):
            if tokens is None or not r.draft_token_ids:
                continue
            emitted = [t.token_id for t in tokens]
            j = len(emitted) - 1
            if j < len(r.draft_token_ids):  # draft j was rejected: emitted[j] is the correction
                before = r.prompt_token_ids + r.output_token_ids + emitted[:j]
                rejected.append(before + [r.draft_token_ids[j]])
        return results

    engine.runner.execute = recording
    prompts = prompts_of(llm)
    outputs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=64))
    assert rejected, "no draft was rejected: the test saw nothing"
    allocator = engine.allocator
    for tokens in rejected:
        # Pad to the end of the rejected token's block, so that block is a full one to look up.
        padded = tokens + [0] * (-len(tokens) % BLOCK_SIZE)
        hits = allocator.lookup(padded)
        allocator.free(hits)
        assert len(hits) <= (len(tokens) - 1) // BLOCK_SIZE, "a block holding a rejected draft is cached"
    for prompt, out in zip(prompts, outputs):
        tokens = prompt + out.outputs[0].token_ids
        hits = allocator.lookup(tokens)
        allocator.free(hits)
        assert len(hits) == (len(tokens) - 1) // BLOCK_SIZE  # all but the last token's KV is computed
    assert allocator.num_used_blocks == 0

# ------------------------------------------------------------------------- configuration and metrics

def test_speculative_config_is_checked():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    one = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    for bad, message in [({"num_speculative_tokens": 4}, "needs a method"),
                         ({"method": "eagle"}, "method must be one of"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
                         ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "must not exceed"),
                         ({"method": "ngram", "lookahead": 2}, "unknown field"),
                         ({"method": "draft_model"}, "needs a model"),
                         ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
                         ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)

def test_drafts_stop_above_disable_by_batch_size():
    """Three requests with disable_by_batch_size 2: no drafts while more than two are in the
    engine, drafts again once only two are left."""
    config = dict(NGRAM, disable_by_batch_size=2)
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, speculative_config=config)
    prompts = prompts_of(llm)[:1] * 3
    lengths = [8, 40, 40]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False)
    assert outputs[0].metrics.num_draft_tokens == 0
    assert all(out.metrics.num_draft_tokens > 0 for out in outputs[1:])


def test_draft_length_doubles_while_accepted_falls_after_a_rejection_and_pauses_on_failure():
    gate = SpeculationGate()
    assert gate.open() and gate.draft_limit(8) == 2
    gate.record(2, 2)
    assert gate.draft_limit(8) == 4
    gate.record(4, 4)
    assert gate.draft_limit(8) == 8 and gate.draft_limit(5) == 5
    gate.record(8, 3)
    assert gate.draft_limit(8) == 4
    gate.record(4, 0)
    assert gate.draft_limit(8) == 1
    failures = 0
    while gate.open():
        gate.record(1, 0)
        failures += 1
    assert 1 <= failures <= 4  # the moving average fell below half a draft: paused
    assert [gate.open() for _ in range(FIRST_PAUSE_STEPS)] == [False] * (FIRST_PAUSE_STEPS - 1) + [True]


def test_ngram_lookup_proposes_what_followed_the_longest_latest_match_and_goes_round_a_loop():
    """Written from the rule: the longest n-gram (of 2..3) ending the context that occurred
    before, its latest occurrence, the tokens after it; past the context's end, round the loop."""
    proposer = NgramProposer(num_tokens=5, min_n=2, max_n=3)

    def propose(tokens: list[int], limit: int = 5, output: list[int] = ()) -> list[int]:
        seq = Sequence("r", tokens, SamplingParams(), seed=0)
        seq.output_token_ids = list(output)
        return proposer.propose_one(seq, limit)

    assert propose([1, 2, 3, 4, 5, 6, 7, 1, 2]) == [3, 4, 5, 6, 7]
    assert propose([1, 2, 3, 4, 5, 6, 7, 1, 2], limit=2) == [3, 4]
    # 9 2 3 occurred once, 2 3 twice: the longer n-gram decides.
    assert propose([9, 2, 3, 10, 11, 2, 3, 12, 13, 9, 2, 3]) == [10, 11, 2, 3, 12]
    # Two occurrences of 2 3: the latest one's continuation.
    assert propose([2, 3, 10, 11, 2, 3, 12, 13, 5, 2, 3]) == [12, 13, 5, 2, 3]
    assert propose([1, 2, 3, 4, 5]) == []  # 4 5 never occurred before
    # A run of one token, and a loop of three: round the loop past the context's end.
    assert propose([8, 7, 7, 7]) == [7, 7, 7, 7, 7]
    assert propose([1, 4, 5, 6, 4, 5, 6, 4, 5], limit=4) == [6, 4, 5, 6]
    # The output counts as context, and the index follows it as it grows.
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), seed=0)
    assert proposer.propose_one(seq, 3) == []
    seq.output_token_ids += [5, 2, 3]
    assert proposer.propose_one(seq, 3) == [4, 5, 2]


def test_a_copied_span_is_verified_in_drafts_longer_than_four():
    """num_speculative_tokens 8 on a request that repeats its prompt: once its drafts are all
    accepted, verifications carry more than four of them, and accept them."""
    config = dict(NGRAM, num_speculative_tokens=8)
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, speculative_config=config)
    out = llm.generate(prompts_of(llm)[:1], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0]
    per_position = llm.engine.speculator.stats()["accepted_per_position"]
    assert len(per_position) == 8 and sum(per_position[4:]) > 0, per_position
    assert out.metrics.mean_accepted_length > 4, out.metrics


def test_draft_model_quantized_drafts_for_dequantized_target():
    """The embedded model's Q4_1/Q8_0 weights draft for its dequantized weights (batch-invariant,
    float32): the target's greedy tokens are unchanged, most drafts are accepted, and every block
    (holding both models' keys and values) is free afterwards."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = make_llm("float32", False, batch_invariant=True, dequantize_weights=True)
    prompts = prompts_of(plain)[:3]
    reference = run(plain, prompts, greedy)
    del plain
    draft = {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3,
             "disable_by_batch_size": 64}
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, batch_invariant=True, dequantize_weights=True,
              speculative_config=draft)
    outputs = run(llm, prompts, greedy)
    assert_same(reference, outputs)
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] / stats["num_draft_tokens"] > 0.5, stats


def test_a_draft_model_of_another_vocabulary_is_a_clear_error(tmp_path, smollm2_hf_tokenizer):
    """A Llama checkpoint of 1000 tokens (the embedded tokenizer beside it) cannot draft for the
    embedded model's 49152."""
    from transformers import LlamaConfig, LlamaForCausalLM

    smollm2_hf_tokenizer.save_pretrained(tmp_path)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="another vocabulary than the target's \\(1000 tokens against 49152"):
        LLM(dtype="float32", speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                 "num_speculative_tokens": 2})


def test_prometheus_counters_have_vllms_names():
    from prometheus_client import generate_latest

    from kvflow.engine.metrics import EngineMetrics

    llm = make_llm("float32", True)
    run(llm, prompts_of(llm)[:1], SamplingParams(temperature=0, max_tokens=32))
    text = generate_latest(EngineMetrics(llm.engine.stats, "m").registry).decode()
    stats = llm.engine.stats()["spec_decode"]
    for name, value in [("spec_decode_num_drafts", stats["num_drafts"]),
                        ("spec_decode_num_draft_tokens", stats["num_draft_tokens"]),
                        ("spec_decode_num_accepted_tokens", stats["num_accepted_tokens"])]:
        assert f'kvflow:{name}_total{{model_name="m"}} {float(value)}' in text
    assert f'kvflow:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} ' \
           f'{float(stats["accepted_per_position"][0])}' in text


def test_server_with_drafts_answers_as_the_plain_engine_and_reports_them():
    """A server on a speculative engine (batch-invariant, float32): a greedy completion, streamed
    and not, has the plain engine's text; bench serve's reading of /metrics counts the drafts the
    requests made."""
    import httpx
    from conftest import running_server

    from kvflow.bench import serve_client
    from kvflow.engine.async_engine import AsyncLLMEngine
    from kvflow.entrypoints.openai.api_server import build_app

    prompt = "Repeat this text exactly:\n\n" + _TEXT + "\n\nRepeated:\n"
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = make_llm("float32", False, batch_invariant=True)
    expected = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    del plain
    llm = make_llm("float32", True, batch_invariant=True)
    body = {"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    with running_server(build_app(AsyncLLMEngine(llm.engine), "m")) as url:
        before = serve_client.fetch_spec_decode_counters(url)
        answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120) as response:
            streamed = "".join(__import__("json").loads(line[6:])["choices"][0]["text"]
                               for line in response.iter_lines() if line.startswith("data: {"))
        summary = serve_client.spec_decode_summary(before, serve_client.fetch_spec_decode_counters(url))
    assert answer["choices"][0]["text"] == expected
    assert streamed == expected
    assert summary["num_draft_tokens"] > 0 and summary["acceptance_length"] > 1
    text = serve_client.format_summary({"completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1,
                                        "total_output_tokens": 1, "request_throughput": 1.0,
                                        "output_throughput": 1.0, "total_token_throughput": 1.0,
                                        "spec_decode": summary, **{f"{s}_{k}_ms": 1.0 for k in
                                                                   ("ttft", "tpot", "itl", "e2e")
                                                                   for s in ("mean", "p50", "p95", "p99")}})
    assert "Acceptance rate at position 0" in text


# ------------------------------------------------------------------------- structured output

_ORDERS = ("Order 1: Alice Martin, 12 Rue de la Paix, Paris, 3 books. Order 2: Bruno Keller, 7 Hauptstrasse, "
           "Berlin, 1 lamp. Order 3: Chika Sato, 4-2 Ginza, Tokyo, 2 cups.")
_ORDERS_SCHEMA = {"type": "object", "required": ["orders"], "properties": {"orders": {"type": "array", "items": {
    "type": "object", "required": ["name", "address", "city"],
    "properties": {"name": {"type": "string"}, "address": {"type": "string"}, "city": {"type": "string"}}}}}}


def constrained_requests(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """An extraction whose JSON copies spans of the prompt (greedy and seeded sampled, n = 2), a
    regex over the same text and a choice: drafts that the grammars allow and ones they forbid."""
    from kvflow import StructuredOutputsParams

    tokenizer = llm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Extract the orders as JSON:\n\n" + _ORDERS}]))
    schema = StructuredOutputsParams(json=_ORDERS_SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=160, structured_outputs=schema, logprobs=1),
              SamplingParams(temperature=0.8, max_tokens=64, seed=3, n=2, structured_outputs=schema),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
                  regex=r"Order [0-9]: [A-Za-z ]+, [^,]+, [A-Za-z]+")),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                  choice=["Paris", "Berlin", "Tokyo"]))]
    return [prompt] * len(params), params


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_outputs_identical_with_and_without_drafts(method):
    """Requests with a JSON schema, a regex and a choice (float32, batch-invariant): the same
    tokens, text, finish reasons and log-probabilities with drafts as without, n-gram drafts
    (cut at the first one the grammar forbids) and the draft model's (drafted under the grammar's
    mask), each verification row masked after the drafts before it; drafts were accepted, the
    JSON parses, and every block is free afterwards."""
    import json

    options = dict(batch_invariant=True, dequantize_weights=method == "draft_model")
    plain = make_llm("float32", False, **options)
    prompts, params = constrained_requests(plain)
    reference = [plain.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    del plain
    config = NGRAM if method == "ngram" else {"method": "draft_model", "model": "SmolLM2-135M-Instruct",
                                              "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, speculative_config=config, **options)
    outputs = [run(llm, [p], sp)[0] for p, sp in zip(prompts, params)]
    assert_same(reference, outputs)
    for a, b in zip(reference[0].outputs[0].logprobs, outputs[0].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    assert json.loads(outputs[0].outputs[0].text)["orders"], outputs[0].outputs[0].text
    extraction = outputs[0].metrics
    assert extraction.num_draft_tokens > 0 and extraction.num_accepted_tokens > 0.3 * extraction.num_draft_tokens, \
        (extraction.num_draft_tokens, extraction.num_accepted_tokens)
    assert llm.engine.allocator.num_used_blocks == 0


def test_grammar_masks_along_drafts_are_the_matchers_step_by_step():
    """GrammarMatcher.fill_bitmasks_along against xgrammar's matcher advanced one token at a time
    (filled, accepted, filled...): the same mask at every draft position; valid_prefix stops at
    the first token the grammar forbids and after a stop token that completes it; neither moves
    the matcher."""
    from kvflow import StructuredOutputsParams

    llm = LLM(dtype="float32")
    engine, tokenizer = llm.engine, llm.tokenizer
    constraint = SamplingParams(structured_outputs=StructuredOutputsParams(json=_ORDERS_SCHEMA))
    tokens = tokenizer.encode('{"orders": [{"name": "Alice Martin", "address": "12 Rue de la Paix", "city": "Paris"}]}')
    stop = min(tokenizer.stop_token_ids)
    words = (engine.model_config.vocab_size + 31) // 32
    grammar = engine.compile_grammar(constraint)
    matcher, reference = engine._grammar_compiler.matcher(grammar), engine._grammar_compiler.matcher(grammar)

    def mask_of(m) -> torch.Tensor:
        mask = torch.zeros((1, words), dtype=torch.int32)
        m.fill_bitmask(mask, 0)
        return mask[0]

    accepted = 0
    for start in (0, 5, len(tokens) - 4):
        for token in tokens[accepted:start]:
            assert matcher.accept(token) and reference.accept(token)
        accepted = start
        drafts = tokens[start:start + 4]
        along = torch.zeros((len(drafts) + 1, words), dtype=torch.int32)
        matcher.fill_bitmasks_along(drafts, along, 0)
        for j in range(len(drafts) + 1):
            assert torch.equal(along[j], mask_of(reference)), f"drafts from token {start}: position {j}'s mask differs"
            if j < len(drafts):
                assert reference.accept(drafts[j])
        reference.rollback(len(drafts))
        assert matcher.valid_prefix(drafts[:3] + [stop] + drafts[3:]) == 3  # the JSON is not complete yet
        assert torch.equal(mask_of(matcher), mask_of(reference)), "the matcher moved"
    for token in tokens[accepted:]:
        assert matcher.accept(token)
    assert matcher.valid_prefix([stop, stop]) == 1 and not matcher.finished
    along = torch.full((3, words), 7, dtype=torch.int32)
    matcher.fill_bitmasks_along([stop], along, 1)  # row 2 would follow the completed grammar
    assert not matcher.finished and along[1].count_nonzero() > 0
    assert torch.equal(along[2], torch.full((words,), 7, dtype=torch.int32))
