"""Real vocabularies of the families kvflow serves, read from llama.cpp's vocabulary-only GGUF files,
against the token ids llama.cpp itself produces for its tokenizer test inputs (tests/data/llama_cpp)."""

import lzma
import shutil
from pathlib import Path

import pytest

from kvflow.tokenizer import Tokenizer

VOCAB_DIR = Path(__file__).parent / "data" / "llama_cpp" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"

# name -> (the stop tokens a chat with that family ends on, BOS added to a prompt)
VOCABULARIES = {
    "qwen2": ({"<|im_end|>", "<|endoftext|>"}, False),
    "phi-3": ({"<|end|>", "<|endoftext|>"}, True),
    "llama-bpe": ({"<|eot_id|>", "<|end_of_text|>"}, True),
    "llama-spm": ({"</s>"}, True),
}


@pytest.fixture(scope="module", params=list(VOCABULARIES))
def vocabulary(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("vocab") / f"ggml-vocab-{name}.gguf"
    with lzma.open(VOCAB_DIR / f"ggml-vocab-{name}.gguf.xz") as packed, open(path, "wb") as out:
        shutil.copyfileobj(packed, out)
    texts = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    expected = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    cases = [(text, [int(token) for token in ids.split()]) for text, ids in zip(texts, expected)]
    assert len(cases) >= 40
    return name, Tokenizer.from_gguf(path), cases


def test_encodes_as_llama_cpp(vocabulary):
    name, tokenizer, cases = vocabulary
    wrong = [(text, ids, tokenizer.encode(text, add_special_tokens=False)) for text, ids in cases
             if tokenizer.encode(text, add_special_tokens=False) != ids]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} texts differ from llama.cpp, first: {wrong[0]}"


def test_decodes_back_to_the_text(vocabulary):
    name, tokenizer, cases = vocabulary
    wrong = [(text, tokenizer.decode(ids)) for text, ids in cases if tokenizer.decode(ids) != text]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} texts decode differently, first: {wrong[0]}"


def test_stop_tokens_and_bos(vocabulary):
    name, tokenizer, _ = vocabulary
    stops, adds_bos = VOCABULARIES[name]
    assert {tokenizer.id_to_token(token_id) for token_id in tokenizer.stop_token_ids} == stops
    assert tokenizer.add_bos_token == adds_bos
    ids = tokenizer.encode("Hello")
    assert (ids[0] == tokenizer.bos_token_id) == adds_bos


def test_special_tokens_in_text_are_matched_whole(vocabulary):
    name, tokenizer, _ = vocabulary
    for stop in VOCABULARIES[name][0]:
        ids = tokenizer.encode(f"a{stop}b", add_special_tokens=False)
        assert tokenizer.token_to_id(stop) in ids
