"""The offline API: kvflow.LLM(...).generate(prompts, params) runs every prompt through the
continuous-batching engine at once and returns the results in input order."""

import dataclasses
import itertools

from kvflow.engine.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.sampling_params import SamplingParams, SamplingParamsError, check_text


class LLM:
    def __init__(self, model: str | None = None, dtype: str | None = None, **engine_options):
        """engine_options: the EngineConfig fields (max_num_seqs, max_num_batched_tokens,
        kv_cache_memory, gpu_memory_utilization, enforce_eager, max_model_len, block_size,
        enable_prefix_caching, threads, seed, device, dequantize_weights, speculative_config (a dict
        as vLLM spells it, e.g. {"method": "ngram", "num_speculative_tokens": 4}), batch_invariant,
        num_scheduler_steps)."""
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt (text, or token ids), in the order given. All or nothing:
        if any prompt or parameter is invalid, no request is added."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and not isinstance(prompts[0], (str, list, tuple))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise SamplingParamsError("prompts", f"must be text, token ids or a list of them, got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise SamplingParamsError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
        checked = [self.engine.prompt_token_ids(prompt) for prompt in prompts]
        for (_, token_ids), params in zip(checked, sampling_params):
            self.engine.check_request(token_ids, params)
        ids = []
        try:
            for (text, token_ids), params in zip(checked, sampling_params):
                request_id = f"offline-{next(self._ids)}"
                # Only finished outputs are returned: the engine need not build the others.
                params = dataclasses.replace(params, output_kind="final_only")
                self.engine.add_request(request_id, token_ids, params, prompt_text=text)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Each conversation (a list of {"role", "content"} messages) through the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        for conversation in conversations:
            for i, message in enumerate(conversation):
                check_text(f"messages[{i}].content", message.get("content") or "")
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generating", unit="req")
        try:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]
