"""The engine on the embedded file's own Q4_1/Q8_0 blocks, as it runs by default: a batch gives each
request exactly what it gets alone, in batch-invariant mode, and in the default mode wherever
attention does not split the lone request's keys.

The quantized products round each activation row to int8 codes of its 32-value blocks, so a few ulps
of float32 difference can move a code by a step of max|x| / 127, and over 30 layers and the decode
steps such steps add up: in the default mode, where attention splits a lone request's keys between
the threads and a batch's not, the 16 prompts' log-probabilities batched and alone differ by up to
~0.9 nats (measured on an AVX-512 BF16 CPU, 0.4 under the AVX2 table), more than a near-tie bound
could allow without hiding real errors. Batch-invariant mode takes one summation order at every batch
size, so there a batch that mixed up requests, blocks or rows would show as any difference at all.
That the default mode's split attention batches correctly is checked in float32 by test_engine.py;
below 64 keys (csrc/cpu/attention.cpp: kMinKeysPerSplit) it splits none, and the int8 products'
sums are exact at any row count, so there the default mode is exact too."""

import gc

import pytest

from test_engine import CHATS, GREEDY, PLAIN_PROMPTS, chat_ids, make_llm, run_alone


pytestmark = pytest.mark.usefixtures("batch_invariant_mode_off_after")


def test_quantized_batch_gives_each_request_its_own_tokens_in_batch_invariant_mode():
    gc.collect()  # the engines of earlier modules are gone, so the process-wide mode may change
    llm = make_llm(enable_prefix_caching=False, dequantize_weights=False, batch_invariant=True)
    assert llm.engine.runner.model.layers[0].mlp.down_proj.ggml_type is not None
    prompts = PLAIN_PROMPTS + [chat_ids(llm, c) for c in CHATS]
    alone = run_alone(llm, prompts, GREEDY)
    step_sizes, schedule = [], llm.engine.scheduler.schedule

    def schedule_and_count():
        plan = schedule()
        step_sizes.append(len(plan.scheduled))
        return plan

    llm.engine.scheduler.schedule = schedule_and_count
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert max(step_sizes) == len(prompts)
    for i, (one, many) in enumerate(zip(alone, batched)):
        expected, got = one.outputs[0], many.outputs[0]
        assert got.token_ids == expected.token_ids, f"prompt #{i}"
        assert got.logprobs == expected.logprobs, f"prompt #{i}"
        assert got.text == expected.text and got.finish_reason == expected.finish_reason == "length"
    assert llm.engine.allocator.num_used_blocks == 0


def test_quantized_batch_gives_short_requests_their_own_tokens_in_the_default_mode():
    llm = make_llm(enable_prefix_caching=False, dequantize_weights=False)
    prompts = PLAIN_PROMPTS + [chat_ids(llm, c) for c in CHATS]
    short = [i for i, p in enumerate(PLAIN_PROMPTS) if len(llm.tokenizer.encode(p)) + GREEDY.max_tokens < 64]
    assert len(short) >= 5, short
    alone = run_alone(llm, [prompts[i] for i in short], GREEDY)
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, one in zip(short, alone):
        assert batched[i].outputs[0].token_ids == one.outputs[0].token_ids, f"prompt #{i}"
        assert batched[i].outputs[0].logprobs == one.outputs[0].logprobs, f"prompt #{i}"
