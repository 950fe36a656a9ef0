"""generate and chat: requests through the engine, text streamed from its step outputs."""

import logging
import sys

from kvflow.engine.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.sampling_params import SamplingParams


def _log(args, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr, flush=True)


def build_engine_config(args) -> EngineConfig:
    """The EngineConfig from the shared engine arguments (cli.add_engine_arguments)."""
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                        enforce_eager=args.enforce_eager, block_size=args.block_size,
                        dequantize_weights=args.dequantize_weights,
                        speculative_config=args.speculative_config, batch_invariant=args.batch_invariant,
                        enable_prefix_caching=args.enable_prefix_caching, threads=args.threads,
                        num_scheduler_steps=args.num_scheduler_steps,
                        tensor_parallel_size=args.tensor_parallel_size,
                        tensor_parallel_timeout=args.tensor_parallel_timeout,
                        seed=args.seed if args.seed is not None else 0)


def _engine(args) -> LLMEngine:
    if not getattr(args, "quiet", False):
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    _log(args, "loading model ...")
    return LLMEngine(build_engine_config(args))


def _sampling_params(args, index: int = 0) -> SamplingParams:
    seed = None if args.seed is None else (args.seed + index) % (1 << 63)
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=seed, stop=list(args.stop), ignore_eos=args.ignore_eos)


def _report(args, output: RequestOutput) -> None:
    m, completion = output.metrics, output.outputs[0]
    tpot = f"TPOT {m.tpot * 1e3:.1f} ms ({1 / m.tpot:.1f} tokens/s)" if m.tpot else "TPOT -"
    _log(args, f"[{output.request_id}: {len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} "
               f"generated ({completion.finish_reason}); TTFT {m.ttft * 1e3:.1f} ms, {tpot}]")


def _run_streaming(engine: LLMEngine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
    engine.add_request(request_id, prompt_ids, params)
    while True:
        for output in engine.step():
            sys.stdout.write(output.outputs[0].delta_text)
            sys.stdout.flush()
            if output.finished:
                sys.stdout.write("\n")
                return output


def _prompt_ids(engine: LLMEngine, args, text: str) -> list[int]:
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def generate(args) -> int:
    _sampling_params(args)  # a bad flag is an error before the model loads
    engine = _engine(args)
    try:
        return _generate(args, engine)
    finally:
        engine.shutdown()


def _generate(args, engine: LLMEngine) -> int:
    if args.prompt is not None:
        output = _run_streaming(engine, "generate-0", _prompt_ids(engine, args, args.prompt), _sampling_params(args))
        _report(args, output)
        return 0
    with open(args.prompts_file) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(f"generate-{i}")
        engine.add_request(ids[-1], _prompt_ids(engine, args, prompt), _sampling_params(args, i))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    for request_id, prompt in zip(ids, prompts):
        sys.stdout.write(f"=== {prompt}\n{finished[request_id].outputs[0].text}\n")
        _report(args, finished[request_id])
    return 0


def chat(args) -> int:
    _sampling_params(args)  # a bad flag is an error before the model loads
    engine = _engine(args)
    try:
        return _chat(args, engine)
    finally:
        engine.shutdown()


def _chat(args, engine: LLMEngine) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    turn = 0
    while True:
        try:
            user = input("> ")
        except EOFError:
            return 0
        if not user.strip():
            return 0
        messages.append({"role": "user", "content": user})
        prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
        output = _run_streaming(engine, f"chat-{turn}", prompt_ids, _sampling_params(args, turn))
        _report(args, output)
        messages.append({"role": "assistant", "content": output.outputs[0].text})
        turn += 1
