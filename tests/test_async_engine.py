"""The asyncio engine: many concurrent streams give what the offline API gives, streamed deltas
join up to the final text, an abandoned or aborted stream frees its blocks, and a rejected
request fails alone."""

import asyncio

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.async_engine import AsyncLLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_seqs=8)


async def collect(engine, request_id, prompt, params=GREEDY, stop_after=None):
    deltas, last = [], None
    async for output in engine.generate(request_id, prompt, params):
        deltas.append(output.outputs[0].delta_text)
        last = output
        if stop_after is not None and len(deltas) >= stop_after:
            break
    return deltas, last


def test_concurrent_streams_match_offline_generate(llm):
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)

    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            return await asyncio.gather(*(collect(engine, f"s{i}", p) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()

    for (deltas, last), want in zip(asyncio.run(run()), expected):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.outputs[0].token_ids == want.outputs[0].token_ids
        assert "".join(deltas) == last.outputs[0].text == want.outputs[0].text
        assert len(deltas) == GREEDY.max_tokens


def test_abandoned_and_aborted_streams_free_their_blocks(llm):
    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            abandoned = asyncio.create_task(collect(engine, "abandoned", PROMPTS[0], long_params, stop_after=3))
            aborted = asyncio.create_task(collect(engine, "aborted", PROMPTS[1], long_params))
            finished = asyncio.create_task(collect(engine, "finished", PROMPTS[2]))
            deltas, last = await abandoned
            assert len(deltas) == 3 and not last.finished
            await asyncio.sleep(0.2)
            await engine.abort("aborted")
            deltas, last = await aborted
            assert last.finished and last.outputs[0].finish_reason == "abort"
            assert 0 < len(last.outputs[0].token_ids) < long_params.max_tokens
            assert "".join(deltas) == last.outputs[0].text
            _, done = await finished
            assert done.finished
            return await engine.stats()
        finally:
            await engine.shutdown()

    stats = asyncio.run(run())
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert llm.engine.allocator.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_rejected_request_fails_alone(llm):
    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            good = asyncio.create_task(collect(engine, "good", PROMPTS[3]))
            with pytest.raises(ValueError, match="context"):
                await collect(engine, "too-long", list(range(1, llm.engine.max_model_len + 5)))
            _, last = await good
            return last
        finally:
            await engine.shutdown()

    last = asyncio.run(run())
    assert last.finished and len(last.outputs[0].token_ids) == GREEDY.max_tokens


def test_from_config_raises_the_load_error_in_the_caller(tmp_path):
    from kvflow.engine.config import EngineConfig

    with pytest.raises(FileNotFoundError, match="neither a GGUF file"):
        AsyncLLMEngine.from_config(EngineConfig(model=str(tmp_path / "missing.gguf")))
