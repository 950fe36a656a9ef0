"""kvflow's tokenizer against independent references: Hugging Face transformers reading the same GGUF
file (the embedded SmolLM2 model), and the sentencepiece library running a model trained here."""

import copy
import json
import random
from pathlib import Path

import gguf
import jinja2
import pytest
import sentencepiece
from transformers import AutoTokenizer

from conftest import SMOLLM2_DIR, SMOLLM2_GGUF
from kvflow.tokenizer import IncrementalDetokenizer, Tokenizer


CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ångström façade",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 and 🤗",
    "def add(a, b):\n\tif a:\n\t\treturn  a + b\n    pass\n",
    "   leading, inner     runs, and trailing   ",
    "line\n\nbreaks\r\nand\n\n\n",
    "中文字符和日本語のテキスト 한국어",
    "12345 3.14159 1,000,000 and  123",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvflow<file_sep>x",
    "text<|im_end|>glued<|im_start|",
    "don't I'LL we've",
    "",
    " ",
    "\t\t",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Ça va ? 😀"},
    ],
]

STREAM_TEXTS = [
    "Hello 😀😀😀 world 👨‍👩‍👧‍👦!",
    "中文字符和日本語のテキスト",
    "café naïve résumé",
    "def f(x):\n\treturn x * 2  # ok\n",
    "🤗🤗🤗🤗 spaced   out",
]


# ------------------------------------------------------------------------- GGUF byte-level BPE


@pytest.fixture(scope="module")
def smollm2_reader():
    return gguf.GGUFReader(SMOLLM2_DIR / SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def bpe_tokenizer(smollm2_reader):
    return Tokenizer.from_gguf(smollm2_reader)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", CORPUS)
def test_gguf_encode_matches_hugging_face(bpe_tokenizer, hf_tokenizer, text, add_special_tokens):
    expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert bpe_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_decode_round_trips_and_matches_hugging_face(bpe_tokenizer, hf_tokenizer, text):
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert bpe_tokenizer.decode(ids) == text
    for skip in (False, True):
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip)
        assert bpe_tokenizer.decode(ids, skip_special_tokens=skip) == expected


def test_gguf_special_tokens_and_ids(bpe_tokenizer, hf_tokenizer):
    assert bpe_tokenizer.vocab_size == len(hf_tokenizer)
    assert bpe_tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert bpe_tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    im_start = hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert bpe_tokenizer.encode("<|im_start|>", add_special_tokens=False) == [im_start]
    assert bpe_tokenizer.token_to_id("<|im_start|>") == im_start
    assert bpe_tokenizer.token_to_id("no such token") is None
    for token_id in (0, 1, 2, 17, 1000, 20000, bpe_tokenizer.vocab_size - 1):
        assert bpe_tokenizer.id_to_token(token_id) == hf_tokenizer.convert_ids_to_tokens(token_id)
    # The end of an assistant turn and the end of a document both stop generation.
    assert bpe_tokenizer.stop_token_ids == {
        hf_tokenizer.eos_token_id,
        hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),
        hf_tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_gguf_pre_tokenizer_name_selects_the_split(tmp_path, bpe_tokenizer, smollm2_reader):
    """A GGUF naming Llama 3's pre-tokenizer splits text with its regex (numbers in groups of three,
    case-insensitive contractions), as Hugging Face does; SmolLM2's vocabulary stands in for Llama 3's."""
    path = tmp_path / "llama3_split.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(smollm2_reader.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(smollm2_reader.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(smollm2_reader.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    _write_metadata_only(writer)

    ours = Tokenizer.from_gguf(path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ["12345 and  123", "DON'T I'LL we've", "a\n\n  b  \n", "<|im_start|>x 1,000,000"]
    for text in texts:
        assert ours.encode(text) == reference.encode(text)
    # SmolLM2's own file names 'smollm', which splits numbers differently, so the choice is visible.
    assert any(ours.encode(text) != bpe_tokenizer.encode(text) for text in texts)


def test_tokenizer_json_directory_matches_hugging_face(tmp_path, hf_tokenizer):
    """The directory layout transformers writes: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    hf_tokenizer.save_pretrained(tmp_path)
    end_of_document = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    repo_name = hf_tokenizer.convert_tokens_to_ids("<repo_name>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_document, repo_name]}))

    ours = Tokenizer.from_pretrained(tmp_path)
    for text in CORPUS:
        assert ours.encode(text) == hf_tokenizer.encode(text)
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert ours.eos_token_id == hf_tokenizer.eos_token_id
    assert repo_name in ours.stop_token_ids
    for conversation in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conversation) == expected


# ------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_hugging_face(bpe_tokenizer, hf_tokenizer, conversation, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert bpe_tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_helpers_match_hugging_face(bpe_tokenizer, hf_tokenizer):
    """tojson without HTML escaping, loop controls, trimmed blocks, bos_token and extra variables."""
    template = (
        "{{ bos_token }}{% for message in messages %}\n"
        "  {% if message.role == 'system' %}{% continue %}{% endif %}\n"
        "  {{ message | tojson }}\n"
        "{% endfor %}\n"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{% if add_generation_prompt %}<go>{% endif %}"
    )
    tools = [{"name": "search", "description": "<b>Find</b> & 'quote' café"}]
    tokenizer = copy.copy(bpe_tokenizer)
    tokenizer.chat_template = template
    for conversation in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            conversation, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.apply_chat_template(conversation, tools=tools) == expected


def test_chat_template_errors(bpe_tokenizer, spm_model):
    tokenizer = copy.copy(bpe_tokenizer)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])
    tokenizer.chat_template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template(CONVERSATIONS[0])
    no_template = Tokenizer.from_pretrained(spm_model.parent)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(CONVERSATIONS[0])


# ------------------------------------------------------------------------- SentencePiece

SPM_CORPUS = [
    "the quick brown fox",
    "  leading spaces and   runs  ",
    "café naïve",
    "def f(x):\n\treturn x\n",
    "numbers 12345 67890",
    # Absent from the training text, so they come out as byte pieces:
    "emoji 😀 and 👨‍👩‍👧",
    "中文 and 日本語",
    "Zebra QUIZ 🤗",
    "",
]
SPM_USER_DEFINED = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A real SentencePiece BPE model with byte fallback, trained on generated text, as a model
    directory holding only tokenizer.model. Identity normalization and kept whitespace runs are how
    Llama's tokenizer.model is set up."""
    directory = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naïve", "résumé",
             "def", "return", "print", "value", "token", "cache", "kv", "flow", "hello", "world"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    lines += ["    indented code\twith a tab", "x = 1 + 2  # sum", "numbers 12345 67890"] * 20
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=SPM_USER_DEFINED,
        minloglevel=2,
    )
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    return directory / "tokenizer.model"


@pytest.fixture(scope="module")
def spm_processor(spm_model):
    return sentencepiece.SentencePieceProcessor(model_file=str(spm_model))


@pytest.fixture(scope="module")
def spm_tokenizer(spm_model):
    return Tokenizer.from_pretrained(spm_model.parent)


@pytest.fixture(scope="module")
def spm_gguf_tokenizer(spm_processor, tmp_path_factory):
    """The trained model's pieces, scores and types, as a GGUF file carries them."""
    def gguf_type(piece_id):
        if spm_processor.is_unknown(piece_id):
            return 2
        if spm_processor.is_control(piece_id):
            return 3
        if spm_processor.id_to_piece(piece_id) in SPM_USER_DEFINED:
            return 4
        if spm_processor.is_byte(piece_id):
            return 6
        return 1

    piece_ids = range(spm_processor.get_piece_size())
    path = tmp_path_factory.mktemp("spm_gguf") / "tokenizer.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([spm_processor.id_to_piece(i) for i in piece_ids])
    writer.add_token_scores([spm_processor.get_score(i) for i in piece_ids])
    writer.add_token_types([gguf_type(i) for i in piece_ids])
    writer.add_bos_token_id(spm_processor.bos_id())
    writer.add_eos_token_id(spm_processor.eos_id())
    writer.add_unk_token_id(spm_processor.unk_id())
    writer.add_add_space_prefix(True)
    _write_metadata_only(writer)
    return Tokenizer.from_gguf(path)


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_sentencepiece_model_encodes_like_sentencepiece(spm_tokenizer, spm_processor, text):
    assert spm_tokenizer.encode(text, add_special_tokens=False) == spm_processor.encode(text)
    assert spm_tokenizer.encode(text) == [spm_processor.bos_id(), *spm_processor.encode(text)]
    assert spm_tokenizer.decode(spm_tokenizer.encode(text, add_special_tokens=False)) == text
    assert spm_tokenizer.decode(spm_tokenizer.encode(text), skip_special_tokens=True) == text


def test_sentencepiece_byte_fallback_is_exercised(spm_tokenizer, spm_processor):
    ids = spm_tokenizer.encode("😀 中文")
    assert any(spm_processor.is_byte(token_id) for token_id in ids)
    assert spm_processor.unk_id() not in ids


def test_sentencepiece_special_tokens(spm_tokenizer, spm_processor):
    bos, eos = spm_processor.bos_id(), spm_processor.eos_id()
    assert (spm_tokenizer.bos_token_id, spm_tokenizer.eos_token_id) == (bos, eos)
    assert spm_tokenizer.stop_token_ids == {eos}
    assert spm_tokenizer.vocab_size == spm_processor.get_piece_size()
    # SentencePiece never reads control pieces from text; Hugging Face and llama.cpp do.
    assert spm_tokenizer.encode("<s>fox</s>", add_special_tokens=False) == [
        bos, *spm_processor.encode("fox"), eos
    ]
    assert spm_tokenizer.decode([bos, *spm_processor.encode("fox"), eos]) == "<s>fox</s>"
    assert spm_tokenizer.decode([bos, *spm_processor.encode("fox"), eos], skip_special_tokens=True) == "fox"
    # User-defined pieces are matched whole by sentencepiece itself.
    text = "<|im_start|>user fox<|im_end|>"
    assert spm_tokenizer.encode(text, add_special_tokens=False) == spm_processor.encode(text)
    assert spm_tokenizer.id_to_token(bos) == spm_processor.id_to_piece(bos)
    assert spm_tokenizer.token_to_id("▁fox") == spm_processor.piece_to_id("▁fox")
    assert spm_tokenizer.token_to_id("not a piece") is None


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_gguf_sentencepiece_vocabulary_encodes_like_sentencepiece(spm_gguf_tokenizer, spm_processor, text):
    assert spm_gguf_tokenizer.encode(text, add_special_tokens=False) == spm_processor.encode(text)
    assert spm_gguf_tokenizer.encode(text) == [spm_processor.bos_id(), *spm_processor.encode(text)]
    assert spm_gguf_tokenizer.decode(spm_gguf_tokenizer.encode(text, add_special_tokens=False)) == text


def test_gguf_sentencepiece_user_defined_tokens_are_single_tokens(spm_gguf_tokenizer, spm_processor):
    im_start, im_end = (spm_processor.piece_to_id(piece) for piece in SPM_USER_DEFINED)
    ids = spm_gguf_tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[0] == im_start and ids[-1] == im_end
    assert spm_gguf_tokenizer.decode(ids) == "<|im_start|>user<|im_end|>"


# ------------------------------------------------------------------------- incremental detokenizer


@pytest.fixture(params=["gguf_bpe", "sentencepiece"])
def any_tokenizer(request, bpe_tokenizer, spm_tokenizer):
    return {"gguf_bpe": bpe_tokenizer, "sentencepiece": spm_tokenizer}[request.param]


def _stream(detokenizer, ids, chunk_sizes):
    pieces, start = [], 0
    for size in chunk_sizes:
        pieces.append(detokenizer.step(ids[start : start + size]))
        start += size
    assert start >= len(ids)
    return pieces + [detokenizer.flush()]


@pytest.mark.parametrize("chunking", ["one_token", "random_chunks"])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_streams_whole_characters(any_tokenizer, text, chunking):
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(1234)
    chunk_sizes = [1] * len(ids) if chunking == "one_token" else [rng.randint(1, 5) for _ in ids]
    pieces = _stream(IncrementalDetokenizer(any_tokenizer), ids, chunk_sizes)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == any_tokenizer.decode(ids)


def test_detokenizer_on_arbitrary_ids(any_tokenizer):
    """Random ids make invalid UTF-8 and stray special tokens; the stream still adds up to decode()."""
    rng = random.Random(7)
    for skip_special_tokens in (False, True):
        ids = [rng.randrange(any_tokenizer.vocab_size) for _ in range(300)]
        chunk_sizes = [rng.randint(1, 3) for _ in ids]
        detokenizer = IncrementalDetokenizer(any_tokenizer, skip_special_tokens=skip_special_tokens)
        pieces = _stream(detokenizer, ids, chunk_sizes)
        assert "".join(pieces) == any_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_holds_back_a_character_split_over_byte_pieces(spm_tokenizer, spm_processor):
    ids = spm_processor.encode("😀", add_bos=False)
    ids = [token_id for token_id in ids if spm_processor.is_byte(token_id)]
    assert len(ids) == 4
    detokenizer = IncrementalDetokenizer(spm_tokenizer, prompt_ids=spm_tokenizer.encode("fox"))
    assert [detokenizer.step([token_id]) for token_id in ids] == ["", "", "", "😀"]


def test_detokenizer_keeps_the_word_start_space_after_a_prompt(any_tokenizer):
    prompt = any_tokenizer.encode("the lazy fox")
    generated = any_tokenizer.encode("the lazy fox jumps over 😀 the dog", add_special_tokens=False)[
        len(any_tokenizer.encode("the lazy fox", add_special_tokens=False)) :
    ]
    detokenizer = IncrementalDetokenizer(any_tokenizer, prompt_ids=prompt)
    # An empty step (a scheduler tick with nothing new) must not lose the context either.
    streamed = "".join(detokenizer.step([token_id]) + detokenizer.step([]) for token_id in generated)
    streamed += detokenizer.flush()
    prompt_text = any_tokenizer.decode(prompt)
    full_text = any_tokenizer.decode(prompt + generated)
    assert full_text.startswith(prompt_text)
    assert streamed == full_text[len(prompt_text) :]
    assert streamed.startswith(" jumps")


def test_detokenizer_flushes_an_unfinished_character(any_tokenizer):
    """Generation that ends inside a character: the held bytes come out of flush, as decode() has them."""
    ids = any_tokenizer.encode("ok 😀👍🏽 fine", add_special_tokens=False)
    cut = next(k for k in range(len(ids), 0, -1) if any_tokenizer.decode(ids[:k]).endswith("\ufffd"))
    prompt = any_tokenizer.encode("say")
    detokenizer = IncrementalDetokenizer(any_tokenizer, prompt_ids=prompt)
    pieces = [detokenizer.step([token_id]) for token_id in ids[:cut]]
    assert pieces[-1] == "" and not any("\ufffd" in piece for piece in pieces)
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")
    prompt_text = any_tokenizer.decode(prompt)
    assert "".join(pieces) + tail == any_tokenizer.decode(prompt + ids[:cut])[len(prompt_text):]
    assert detokenizer.flush() == ""


def test_detokenizer_steps_once_per_token_with_tokenizers_stream(bpe_tokenizer, monkeypatch):
    """A tokenizers-backed vocabulary streams through its own incremental decoder: no window decodes."""
    detokenizer = IncrementalDetokenizer(bpe_tokenizer, prompt_ids=bpe_tokenizer.encode("the"))
    decodes = []
    monkeypatch.setattr(bpe_tokenizer, "decode", lambda *a, **k: decodes.append(a))
    text = "".join(detokenizer.step([token_id]) for token_id in bpe_tokenizer.encode(" lazy dog", add_special_tokens=False))
    assert text == " lazy dog" and decodes == []


def test_detokenizer_work_per_step_is_bounded(any_tokenizer):
    """Each step decodes a short window, not everything generated so far."""
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            decoded_lengths.append(len(ids))
            return any_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = any_tokenizer.encode(" the quick brown fox" * 100, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(CountingTokenizer())
    for token_id in ids:
        detokenizer.step([token_id])
    assert max(decoded_lengths) <= 4


# ------------------------------------------------------------------------- errors


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path)


def test_gguf_with_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(path, arch="rwkv6")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    _write_metadata_only(writer)
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'rwkv'"):
        Tokenizer.from_gguf(path)


def test_gguf_without_tokenizer(tmp_path):
    path = tmp_path / "weights_only.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    _write_metadata_only(writer)
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf(path)


def _write_metadata_only(writer: gguf.GGUFWriter):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
