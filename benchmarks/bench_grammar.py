"""The two grammar engines structured output could use, measured on kvflow's own tokenizers: xgrammar
(0.2.x) and llguidance (1.x), both from PyPI.

For each engine and vocabulary (the embedded SmolLM2's 49,152 tokens, and a byte-level BPE of
about 150,000 trained here on generated text, the size of Qwen2's and Llama 3's):
- compile: from the JSON schema text to the first token mask (tokenizer preparation, which
  happens once per model, is timed apart);
- mask: the time to compute one step's token bitmask, median and P99 over a walk through a valid
  instance of the schema, token by token (each step also advances the matcher by the token).

    python benchmarks/bench_grammar.py [--rounds 3]

Needs both packages: pip install xgrammar llguidance.
"""

import argparse
import json
import random
import statistics
import string
import time

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvflow.loader.model_loader import resolve_model_path
from kvflow.tokenizer import Tokenizer

# An extraction schema of the kind agents send: nested objects, arrays, enums, a pattern, numbers
# with bounds, optional fields, no additional properties.
SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "issued": {"type": "string", "format": "date"},
        "status": {"enum": ["draft", "sent", "paid", "overdue"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": ["string", "null"]},
    },
    "required": ["invoice_id", "issued", "status", "customer", "lines"],
    "additionalProperties": False,
}

INSTANCE = {
    "invoice_id": "INV-004217",
    "issued": "2026-11-30",
    "status": "sent",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True},
    "lines": [{"sku": "KB-101", "quantity": 2, "unit_price": 49.5},
              {"sku": "MS-7", "quantity": 1, "unit_price": 19.99},
              {"sku": "CAB-USB-C", "quantity": 4, "unit_price": 7.25}],
    "notes": None,
}


def smollm2_tokenizer() -> tuple[tokenizers.Tokenizer, int]:
    tokenizer = Tokenizer.from_gguf(resolve_model_path(None))
    return tokenizer._backend.tokenizer, tokenizer.eos_token_id


def large_bpe_tokenizer(vocab_size: int = 150_000) -> tuple[tokenizers.Tokenizer, int]:
    """A byte-level BPE trained on generated words until it holds vocab_size tokens."""
    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + "_-.:/"

    def word():
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 12)))

    corpus = [" ".join(word() for _ in range(200)) for _ in range(6000)] + [json.dumps(INSTANCE)] * 50
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer, tokenizer.token_to_id("<|endoftext|>")


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos: int):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def start(self, schema: str):
        matcher = self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        return matcher, mask

    def fill(self, state) -> None:
        matcher, mask = state
        matcher.fill_next_token_bitmask(mask, 0)

    def accept(self, state, token: int) -> bool:
        return state[0].accept_token(token)


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos: int):
        import llguidance
        import llguidance.numpy

        self.llg = llguidance
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    def start(self, schema: str):
        matcher = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_json_schema(schema))
        assert not matcher.is_error(), matcher.get_error()
        return matcher, self.llg.numpy.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, state) -> None:
        matcher, mask = state
        self.llg.numpy.fill_next_token_bitmask(matcher, mask, 0)

    def accept(self, state, token: int) -> bool:
        return state[0].consume_token(token)


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask.reshape(-1)[token // 32]) >> (token % 32)) & 1)


def measure(engine, tokens: list[int]) -> dict:
    schema = json.dumps(SCHEMA)
    start = time.perf_counter()
    state = engine.start(schema)
    engine.fill(state)
    compile_ms = (time.perf_counter() - start) * 1e3
    mask_us = []
    for i, token in enumerate(tokens):
        if i:
            begin = time.perf_counter()
            engine.fill(state)
            mask_us.append((time.perf_counter() - begin) * 1e6)
        mask = state[1]
        mask_array = mask.numpy() if hasattr(mask, "numpy") else mask
        if not allowed(mask_array, token):
            raise AssertionError(f"{engine.name} masks out token {i} ({token}) of the valid instance")
        if not engine.accept(state, token):
            raise AssertionError(f"{engine.name} refused token {i} ({token})")
    mask_us.sort()
    return {"compile_ms": compile_ms, "mask_median_us": statistics.median(mask_us),
            "mask_p99_us": mask_us[min(len(mask_us) - 1, int(0.99 * len(mask_us)))], "steps": len(mask_us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    text = json.dumps(INSTANCE)
    rows = []
    for vocab_name, make in (("SmolLM2 (49,152)", smollm2_tokenizer), ("BPE (150,000)", large_bpe_tokenizer)):
        tokenizer, eos = make()
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        for engine_class in (XGrammarEngine, LLGuidanceEngine):
            start = time.perf_counter()
            engine = engine_class(tokenizer, eos)
            setup_ms = (time.perf_counter() - start) * 1e3
            for round_index in range(args.rounds):
                result = measure(engine, tokens)
                rows.append((vocab_name, engine.name, round_index + 1, setup_ms, result))
                print(rows[-1], flush=True)
    print("\n| vocabulary | engine | round | tokenizer setup (ms) | schema to first mask (ms) | mask median (us) "
          "| mask P99 (us) | steps |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for vocab_name, name, round_index, setup_ms, r in rows:
        print(f"| {vocab_name} | {name} | {round_index} | {setup_ms:.0f} | {r['compile_ms']:.1f} | "
              f"{r['mask_median_us']:.1f} | {r['mask_p99_us']:.1f} | {r['steps']} |")


if __name__ == "__main__":
    main()
