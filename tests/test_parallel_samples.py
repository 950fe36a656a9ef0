"""Parallel samples (SamplingParams.n): they share the prompt's KV blocks (forked, copied on
write), and each gives exactly what a lone request with its derived seed gives, so sharing never
leaks one sample's keys and values into another's."""

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.llm_engine import sample_seed

PROMPT = ("You are a helpful assistant. Answer briefly and precisely, in plain words, and do not repeat the "
          "question. Question: write a short poem about the sea and the wind.")


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


def test_each_sample_equals_a_lone_request_with_its_seed(llm):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    texts = set()
    for c in out.outputs:
        alone = SamplingParams(temperature=0.9, top_p=0.95, seed=sample_seed(11, c.index), max_tokens=24,
                               ignore_eos=True)
        (reference,) = llm.generate([PROMPT], alone, use_tqdm=False)
        assert c.token_ids == reference.outputs[0].token_ids
        assert c.text == reference.outputs[0].text and c.finish_reason == "length"
        texts.add(c.text)
    assert len(texts) > 1  # different seeds, different samples
    assert llm.engine.allocator.num_used_blocks == 0


def test_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 2 * engine.scheduler.config.block_size
    engine.add_request("shared", prompt_ids, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6,
                                                           ignore_eos=True))
    engine.step()  # the prompt, once, by sample 0; the others fork its blocks
    engine.step()  # samples 1..3 compute the last prompt token, each in its own copy of the last block
    seqs = [s.seq for s in engine._requests["shared"].samples]
    full_prompt_blocks = len(prompt_ids) // engine.scheduler.config.block_size
    first_block = seqs[0].block_table[0]
    assert all(seq.block_table[:full_prompt_blocks] == seqs[0].block_table[:full_prompt_blocks] for seq in seqs)
    assert engine.allocator.ref_count(first_block) == 4
    last = [seq.block_table[full_prompt_blocks] for seq in seqs]
    assert len(set(last)) == 4  # the partial block holding generated tokens is private to each
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and all(len(c.token_ids) == 6 for c in outputs[-1].outputs)
    assert engine.allocator.num_used_blocks == 0


def test_greedy_samples_agree(llm):
    (many,) = llm.generate([PROMPT], SamplingParams(n=2, temperature=0, max_tokens=16), use_tqdm=False)
    (one,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert many.outputs[0].token_ids == many.outputs[1].token_ids == one.outputs[0].token_ids
