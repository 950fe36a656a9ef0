"""generate and chat: load the model, then stream tokens through the incremental detokenizer."""

import sys

from kvflow.engine.model_runner import ModelRunner
from kvflow.engine.sampling_params import SamplingParams
from kvflow.engine.single_sequence import GenerationTimings, generate_tokens
from kvflow.engine.stop_strings import StopStringMatcher
from kvflow.entrypoints.cli import DTYPES
from kvflow.loader import LoadedModel, load_model
from kvflow.tokenizer import IncrementalDetokenizer


def _log(args, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr, flush=True)


def _load(args) -> tuple[LoadedModel, ModelRunner]:
    _log(args, "loading model ...")
    loaded = load_model(args.model, DTYPES[args.dtype], args.device)
    context = loaded.config.max_position_embeddings
    tokens = min(args.kv_cache_tokens or context, context)
    block_size = 16
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=-(-tokens // block_size), block_size=block_size,
                         device=args.device)
    _log(args, f"loaded {loaded.path} ({loaded.config.architecture}, {args.dtype}) in {loaded.load_seconds:.2f} s")
    return loaded, runner


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)


def _stream(loaded: LoadedModel, runner: ModelRunner, prompt_ids: list[int], params: SamplingParams,
            out) -> tuple[str, GenerationTimings, str | None]:
    """Writes the completion to out as it is produced; returns (text, timings, finish reason)."""
    detokenizer = IncrementalDetokenizer(loaded.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
    stops = StopStringMatcher(params.stop)
    timings = GenerationTimings()
    text, finish = "", None
    for step in generate_tokens(runner, prompt_ids, params, loaded.tokenizer.stop_token_ids, timings):
        piece, stopped = stops.feed(detokenizer.step([step.token_id]))
        finish = "stop" if stopped else step.finish_reason
        if finish is not None and not stopped:
            piece += stops.feed(detokenizer.flush())[0] + stops.flush()
        out.write(piece)
        out.flush()
        text += piece
        if stopped:
            break
    return text, timings, finish


def _report(args, timings: GenerationTimings, finish: str | None) -> None:
    generated = len(timings.token_times)
    rate = (generated - 1) / (timings.token_times[-1] - timings.token_times[0]) if generated > 1 else 0.0
    _log(args, f"[{timings.prompt_tokens} prompt tokens, {generated} generated ({finish}); "
               f"TTFT {timings.ttft * 1e3:.1f} ms, TPOT {timings.tpot * 1e3:.1f} ms ({rate:.1f} tokens/s)]")


def generate(args) -> int:
    loaded, runner = _load(args)
    params = _sampling_params(args)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = loaded.tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    prompt_ids = loaded.tokenizer.encode(prompt)
    _, timings, finish = _stream(loaded, runner, prompt_ids, params, sys.stdout)
    sys.stdout.write("\n")
    _report(args, timings, finish)
    return 0


def chat(args) -> int:
    loaded, runner = _load(args)
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            return 0
        if not user.strip():
            return 0
        messages.append({"role": "user", "content": user})
        prompt_ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages))
        answer, timings, finish = _stream(loaded, runner, prompt_ids, params, sys.stdout)
        sys.stdout.write("\n")
        _report(args, timings, finish)
        messages.append({"role": "assistant", "content": answer})
