"""The command line. Only the completion goes to stdout, so that it can be piped; progress and
timings go to stderr."""

import argparse
import sys

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a GGUF file, a Hugging Face directory (config.json + safetensors), or the name of the "
                             "embedded default SmolLM2-135M-Instruct (the default)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                        help="weights and activations (quantized GGUF weights are dequantized at load)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache size in tokens (default: the model's context length)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=None, help="fixes the random draws")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvflow", description="kvflow: an LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream the completion of one prompt to stdout")
    generate.add_argument("prompt", help="the prompt text; special tokens written in it (e.g. <|im_start|>) "
                                         "are read as special tokens")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--system", default=None, help="a system message (with --chat)")
    generate.add_argument("--quiet", action="store_true", help="no progress or timings on stderr")
    add_model_arguments(generate)
    add_sampling_arguments(generate)

    chat = commands.add_parser("chat", help="an interactive conversation in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    add_model_arguments(chat)
    add_sampling_arguments(chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvflow.entrypoints import cli_commands

    try:
        if args.command == "generate":
            return cli_commands.generate(args)
        return cli_commands.chat(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
