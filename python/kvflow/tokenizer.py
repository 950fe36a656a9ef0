"""Text to token ids and back, for a Hugging Face model directory or for the vocabulary a GGUF file
carries, plus the chat template and an incremental detokenizer for streaming.

Two backends do the actual splitting:
- the `tokenizers` library, for `tokenizer.json` and for GGUF byte-level BPE vocabularies ('gpt2');
- `sentencepiece`, for `tokenizer.model` and for GGUF SentencePiece vocabularies ('llama'), which are
  rebuilt into a real SentencePiece model so the library's own BPE-by-score and byte fallback apply.
"""

import functools
import json
import re
import struct
from datetime import datetime
from pathlib import Path

import gguf
import jinja2
import jinja2.sandbox
import sentencepiece
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type); SentencePiece's ModelProto uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end an assistant turn in common chat formats. One counts as a stop token only when
# the vocabulary has it as a special token, so ordinary text that spells it never stops generation.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
)

# Pre-tokenizer split patterns for the `tokenizer.ggml.pre` names whose merges were learned on them
# (the regexes of the original tokenizer.json files). Any other name gets GPT-2's byte-level split,
# as Hugging Face does when it reads a GGUF.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# Pre-tokenizers whose words are looked up whole before any merge (Llama 3's tokenizer.json sets
# `ignore_merges`, and llama.cpp does the same for these names): a word in the vocabulary is one token
# even when no chain of merges builds it.
GGUF_WHOLE_WORD_FIRST = ("llama-bpe", "llama3", "llama-v3")

REPLACEMENT_CHAR = "\ufffd"


class _TokenizersBackend:
    """A `tokenizers.Tokenizer`; its added tokens already split special-token text out of the input."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        self.special_token_ids = {
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        }

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, context_ids: list[int], skip_special_tokens: bool):
        """tokenizers' own incremental decoder, primed with context_ids: one call into Rust per
        token instead of two decodes and the slicing around them."""
        stream = decoders.DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self.tokenizer)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


class _SentencePieceBackend:
    """A SentencePiece processor, with special tokens split out of the text before it sees it.

    SentencePiece never matches a control piece such as `<s>` in text, and Hugging Face and llama.cpp
    do, so the text is cut at every special or added token and each stretch in between is encoded on
    its own, so it starts with the dummy-prefix space, as in llama.cpp.
    """

    def __init__(
        self,
        processor: sentencepiece.SentencePieceProcessor,
        special_tokens: dict[str, int],
        added_tokens: dict[str, int] | None = None,
    ):
        self.processor = processor
        self.special_token_ids = set(special_tokens.values())
        all_tokens = {**(added_tokens or {}), **special_tokens}
        self._text_of_id = {token_id: text for text, token_id in all_tokens.items()}
        self._id_of_text = {text: token_id for token_id, text in self._text_of_id.items()}
        # Longest first, so that at a given position the longest token wins, as with Hugging Face's trie.
        alternatives = sorted(self._id_of_text, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(text) for text in alternatives)) if alternatives else None

    @property
    def vocab_size(self) -> int:
        return max([self.processor.get_piece_size(), *(token_id + 1 for token_id in self._text_of_id)])

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.processor.encode(text)
        ids, start = [], 0
        for match in self._split.finditer(text):
            if match.start() > start:
                ids += self.processor.encode(text[start : match.start()])
            ids.append(self._id_of_text[match.group()])
            start = match.end()
        if start < len(text):
            ids += self.processor.encode(text[start:])
        return ids

    def stream_decoder(self, context_ids: list[int], skip_special_tokens: bool) -> None:
        return None  # IncrementalDetokenizer decodes windows itself

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        parts, run = [], []
        for token_id in ids:
            if token_id not in self._text_of_id:
                run.append(token_id)
                continue
            if run:
                parts.append(self.processor.decode(run))
                run = []
            if not (skip_special_tokens and token_id in self.special_token_ids):
                parts.append(self._text_of_id[token_id])
        if run:
            parts.append(self.processor.decode(run))
        return "".join(parts)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._text_of_id:
            return self._text_of_id[token_id]
        if 0 <= token_id < self.processor.get_piece_size():
            return self.processor.id_to_piece(token_id)
        return None

    def token_to_id(self, token: str) -> int | None:
        if token in self._id_of_text:
            return self._id_of_text[token]
        token_id = self.processor.piece_to_id(token)
        if token_id == self.processor.unk_id() and token != self.processor.id_to_piece(token_id):
            return None
        return token_id


class Tokenizer:
    """Encodes text to token ids and decodes them back, and renders chat templates.

    Build one with `Tokenizer.from_pretrained(directory)` or `Tokenizer.from_gguf(path_or_reader)`.
    """

    def __init__(
        self,
        backend: _TokenizersBackend | _SentencePieceBackend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_stop_token_ids: tuple[int, ...] = (),
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and eos_token_id is not None
        self.chat_template = chat_template

        stop = {token_id for token_id in (eos_token_id, *extra_stop_token_ids) if token_id is not None}
        for text in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None and token_id in backend.special_token_ids:
                stop.add(token_id)
        self.stop_token_ids = frozenset(stop)

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "Tokenizer":
        """From a Hugging Face model directory: `tokenizer.json`, else SentencePiece's `tokenizer.model`,
        with `tokenizer_config.json`, `generation_config.json` and `config.json` where present."""
        directory = Path(directory)
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        if (directory / "tokenizer.json").is_file():
            backend = _TokenizersBackend(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")))
        elif (directory / "tokenizer.model").is_file():
            backend = _sentencepiece_backend_from_file(
                directory / "tokenizer.model", tokenizer_config.get("added_tokens_decoder", {})
            )
        else:
            raise FileNotFoundError(
                f"no tokenizer in {directory}: expected tokenizer.json (Hugging Face tokenizers) "
                "or tokenizer.model (SentencePiece)"
            )

        model_config = _read_json(directory / "config.json")
        generation_config = _read_json(directory / "generation_config.json")
        config_eos_ids = _config_ids("eos_token_id", generation_config, model_config)

        def token_id(name: str) -> int | None:
            text = _token_content(tokenizer_config.get(name))
            return backend.token_to_id(text) if text is not None else None

        bos_token_id = token_id("bos_token")
        eos_token_id = token_id("eos_token")
        if bos_token_id is None:
            bos_token_id = _first(_config_ids("bos_token_id", generation_config, model_config))
        if eos_token_id is None:
            eos_token_id = _first(config_eos_ids)
        if isinstance(backend, _SentencePieceBackend):
            if bos_token_id is None and backend.processor.bos_id() >= 0:
                bos_token_id = backend.processor.bos_id()
            if eos_token_id is None and backend.processor.eos_id() >= 0:
                eos_token_id = backend.processor.eos_id()

        add_bos_token = tokenizer_config.get("add_bos_token")
        add_eos_token = tokenizer_config.get("add_eos_token")
        if isinstance(backend, _TokenizersBackend):
            # Without explicit flags, tokenizer.json's post-processor says what gets added; read it
            # off once so that BOS/EOS handling lives in one place (encode) for every backend.
            with_specials = backend.tokenizer.encode("a", add_special_tokens=True).ids
            without = backend.encode("a")
            if add_bos_token is None:
                add_bos_token = with_specials[:1] == [bos_token_id] and without[:1] != [bos_token_id]
            if add_eos_token is None:
                add_eos_token = with_specials[-1:] == [eos_token_id] and without[-1:] != [eos_token_id]
        elif add_bos_token is None:
            add_bos_token = True  # the SentencePiece convention (Llama, Mistral): BOS starts every prompt

        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            add_bos_token=bool(add_bos_token),
            add_eos_token=bool(add_eos_token),
            chat_template=_chat_template_from(tokenizer_config, directory),
            extra_stop_token_ids=tuple(config_eos_ids),
            unk_token_id=token_id("unk_token"),
            pad_token_id=token_id("pad_token"),
        )

    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        """From the vocabulary embedded in a GGUF file (a path or an open `gguf.GGUFReader`)."""
        reader = reader_or_path
        if not isinstance(reader, gguf.GGUFReader):
            reader = gguf.GGUFReader(reader_or_path)
        metadata = {
            key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")
        }
        return cls.from_gguf_metadata(metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        """From GGUF tokenizer metadata as a dict keyed by llama.cpp's names (`tokenizer.ggml.tokens`, ...)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            raise ValueError("the GGUF file has no tokenizer: 'tokenizer.ggml.model' is missing")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ValueError("the GGUF file has no vocabulary: 'tokenizer.ggml.tokens' is missing")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe_from_gguf(metadata, tokens, token_types)
        elif kind == "llama":
            backend = _sentencepiece_from_gguf(metadata, tokens, token_types)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model): kvflow reads "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
            )

        unk_token_id = metadata.get("tokenizer.ggml.unknown_token_id")
        if unk_token_id is None and UNKNOWN in token_types:
            unk_token_id = token_types.index(UNKNOWN)
        end_of_turn_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        extra_stops = tuple(metadata[key] for key in end_of_turn_keys if key in metadata)
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            # Without the key, llama.cpp's defaults: BOS for SentencePiece and Llama 3's BPE.
            add_bos_token=metadata.get("tokenizer.ggml.add_bos_token",
                                       kind == "llama" or metadata.get("tokenizer.ggml.pre") in GGUF_WHOLE_WORD_FIRST),
            add_eos_token=metadata.get("tokenizer.ggml.add_eos_token", False),
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_stop_token_ids=extra_stops,
            unk_token_id=unk_token_id,
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        )

    # ---------------------------------------------------------------- ids

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self._backend.special_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text in it (`<|im_start|>`) becomes that one token;
        with add_special_tokens, BOS/EOS are added where the model wants them."""
        ids = self._backend.encode(text)
        if add_special_tokens:
            if self.add_bos_token:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(token_id) for token_id in ids], skip_special_tokens)

    def stream_decoder(self, context_ids: list[int], skip_special_tokens: bool = False):
        """A function token_id -> the text it completes, or None while that text is held back,
        continuing the text of context_ids; None where the backend has no incremental decoder."""
        return self._backend.stream_decoder(context_ids, skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def _token_text(self, token_id: int | None) -> str | None:
        return self.id_to_token(token_id) if token_id is not None else None

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> str:
        """The prompt text for a conversation, rendered the way Hugging Face transformers renders
        the model's chat template. Extra keyword arguments (`tools=...`) reach the template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; format the prompt yourself and call encode()")
        variables = {
            "bos_token": self._token_text(self.bos_token_id) or "",
            "eos_token": self._token_text(self.eos_token_id) or "",
            "unk_token": self._token_text(self.unk_token_id) or "",
            "pad_token": self._token_text(self.pad_token_id) or "",
            **template_kwargs,
        }
        return _compile_chat_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive, for streaming.

    Every `step` returns only the new text. Text is held back while it ends in an incomplete UTF-8
    character (decoded as U+FFFD), so no piece ever carries half a character; `flush()` returns what
    is still held at the end (only a real trailing U+FFFD). Joined, the pieces equal
    `tokenizer.decode(generated_ids)`, or with prompt_ids, the text that the generated ids add to the
    prompt's.

    Each step decodes a short window: the tokens from `prefix_offset` on, where the tokens before
    `read_offset` were already returned; the window only grows while its text stays incomplete.
    Decoding from a token before the new ones keeps their context, such as the leading space of a
    SentencePiece word-start piece, which a decode of the new tokens alone would drop. Where the
    tokenizer has an incremental decoder of its own (tokenizers' DecodeStream runs this same window
    scheme in Rust), steps go to it, and its offsets are followed here only for `flush`.
    """

    # Prompt tokens decoded in front of the first generated ones, to give them their context.
    PROMPT_CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids=None, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = [int(token_id) for token_id in prompt_ids or ()]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - self.PROMPT_CONTEXT_TOKENS)
        self._stream_step = self._new_stream()
        self._prefix_text = None if self._stream_step else self._decode(self._prefix_offset, self._read_offset)
        # Characters already returned from tokens past read_offset, while their text is incomplete.
        self._returned_unread_chars = 0

    def _new_stream(self):
        """The tokenizer's incremental decoder primed with the current prefix, or None."""
        stream_decoder = getattr(self._tokenizer, "stream_decoder", None)
        if stream_decoder is None:
            return None
        return stream_decoder(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _unreturned_text(self) -> str:
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset)
        return window_text[len(prefix_text) + self._returned_unread_chars :]

    def _advance(self):
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._returned_unread_chars = 0
        if self._stream_step is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def step(self, new_token_ids) -> str:
        """Adds generated ids and returns the text they complete."""
        new_token_ids = [int(token_id) for token_id in new_token_ids]
        if not new_token_ids:
            return ""  # advancing here would drop the context the next token needs
        if self._stream_step is not None:
            text = ""
            for token_id in new_token_ids:
                self._ids.append(token_id)
                piece = self._stream_step(token_id)
                if piece is not None:
                    text += piece
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text
        self._ids.extend(new_token_ids)
        text = self._unreturned_text()
        if text.endswith(REPLACEMENT_CHAR):
            # The tail may be the first bytes of a character; return what precedes it and wait.
            complete = text.rstrip(REPLACEMENT_CHAR)
            self._returned_unread_chars += len(complete)
            return complete
        self._advance()
        return text

    def flush(self) -> str:
        """The text still held back once generation has ended."""
        if self._read_offset == len(self._ids):
            return ""
        text = self._unreturned_text()
        self._advance()
        if self._stream_step is not None:
            self._stream_step = self._new_stream()
        return text


# -------------------------------------------------------------------- GGUF vocabularies


def _byte_level_bpe_from_gguf(metadata: dict, tokens: list[str], token_types: list[int]) -> _TokenizersBackend:
    """Byte-level BPE: the tokens are already spelled in GPT-2's byte alphabet ('Ġ' for a space)."""
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("the GGUF 'gpt2' tokenizer has no merges: 'tokenizer.ggml.merges' is missing")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    ignore_merges = metadata.get("tokenizer.ggml.pre") in GGUF_WHOLE_WORD_FIRST
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )

    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    split = GGUF_PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(tokenizer, tokens, token_types)
    return _TokenizersBackend(tokenizer)


def _add_gguf_special_tokens(tokenizer: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]):
    """Control (and unknown) tokens become special tokens, user-defined ones plain added tokens, so
    that their text in a prompt is matched whole, as llama.cpp and Hugging Face do."""
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type in (CONTROL, UNKNOWN)
    ]
    added = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == USER_DEFINED
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if added:
        tokenizer.add_tokens(added)


def _sentencepiece_from_gguf(metadata: dict, tokens: list[str], token_types: list[int]) -> _SentencePieceBackend:
    """A SentencePiece vocabulary: pieces with scores, merged highest score first (SentencePiece BPE,
    which is what llama.cpp runs for 'llama' vocabularies), bytes as `<0xNN>` pieces."""
    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = [token_type if token_type in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
             for token_type in token_types]
    # SentencePiece needs exactly one unknown piece: the one the metadata names, else the first of
    # type 2. Other pieces of type 2 (Phi-3's padding tokens) become control pieces, which
    # SentencePiece never produces from text; they are still matched whole as special tokens.
    special_types = list(types)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        if UNKNOWN not in types:
            raise ValueError("the GGUF 'llama' tokenizer has no unknown token (no token of type 2, "
                             "no tokenizer.ggml.unknown_token_id)")
        unk_id = types.index(UNKNOWN)
    types = [CONTROL if token_type == UNKNOWN else token_type for token_type in types]
    types[unk_id] = UNKNOWN
    special_types[unk_id] = UNKNOWN
    if 0 < types.count(BYTE) < 256:
        # SentencePiece's byte fallback needs every `<0xNN>` piece and refuses a partial set.
        raise ValueError(
            f"the GGUF 'llama' tokenizer has {types.count(BYTE)} byte tokens (type 6); expected 0 or 256"
        )
    proto = _sentencepiece_model_proto(
        list(zip(tokens, scores, types)),
        add_dummy_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        remove_extra_whitespaces=bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", False)),
        byte_fallback=BYTE in types,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=proto)
    special = {token: token_id for token_id, (token, token_type) in enumerate(zip(tokens, special_types))
               if token_type in (CONTROL, UNKNOWN)}
    added = {token: token_id for token_id, (token, token_type) in enumerate(zip(tokens, special_types))
             if token_type == USER_DEFINED}
    return _SentencePieceBackend(processor, special, added)


def _sentencepiece_model_proto(
    pieces: list[tuple[str, float, int]],
    *,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    byte_fallback: bool,
) -> bytes:
    """A serialized sentencepiece ModelProto, written by hand so that no protobuf package is needed.

    Only the fields that encoding and decoding read: the pieces (piece = 1, score = 2, type = 3),
    TrainerSpec (model_type = 3 with BPE = 2, vocab_size = 4, byte_fallback = 35) and NormalizerSpec
    (name = 1, add_dummy_prefix = 3, remove_extra_whitespaces = 4, escape_whitespaces = 5); the
    "identity" normalizer leaves the text as it is, as llama.cpp does.
    """
    serialized = bytearray()
    for piece, score, piece_type in pieces:
        entry = _proto_bytes(1, piece.encode("utf-8")) + _proto_float(2, score) + _proto_varint(3, piece_type)
        serialized += _proto_bytes(1, entry)
    trainer_spec = _proto_varint(3, 2) + _proto_varint(4, len(pieces)) + _proto_varint(35, int(byte_fallback))
    normalizer_spec = (
        _proto_bytes(1, b"identity")
        + _proto_varint(3, int(add_dummy_prefix))
        + _proto_varint(4, int(remove_extra_whitespaces))
        + _proto_varint(5, 1)
    )
    serialized += _proto_bytes(2, trainer_spec) + _proto_bytes(3, normalizer_spec)
    return bytes(serialized)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _proto_varint(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _proto_bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def _proto_float(field: int, value: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", value)


# -------------------------------------------------------------------- Hugging Face directories


def _sentencepiece_backend_from_file(path: Path, added_tokens_decoder: dict) -> _SentencePieceBackend:
    """`tokenizer.model`, with its control pieces (`<s>`, `</s>`) and unknown piece as special tokens,
    plus the tokens tokenizer_config.json adds (which may lie past the model's own pieces)."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    special, added = {}, {}
    for token_id in range(processor.get_piece_size()):
        if processor.is_control(token_id) or processor.is_unknown(token_id):
            special[processor.id_to_piece(token_id)] = token_id
    for token_id, entry in added_tokens_decoder.items():
        content = _token_content(entry)
        is_special = entry.get("special", True) if isinstance(entry, dict) else True
        (special if is_special else added)[content] = int(token_id)
    return _SentencePieceBackend(processor, special, added)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(token) -> str | None:
    """A token as tokenizer_config.json writes it: a string or an AddedToken dict with 'content'."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _config_ids(key: str, *configs: dict) -> list[int]:
    """The ids under `key` in each config, in order; a config may hold one id or a list of them."""
    ids = []
    for config in configs:
        value = config.get(key)
        if isinstance(value, (list, tuple)):
            ids += [int(v) for v in value]
        elif value is not None:
            ids.append(int(value))
    return ids


def _first(values: list[int]) -> int | None:
    return values[0] if values else None


def _chat_template_from(tokenizer_config: dict, directory: Path) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template


# -------------------------------------------------------------------- chat templates


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    """Chat templates come with downloaded models and are untrusted code: render them in Jinja's
    immutable sandbox, with the settings and helpers that transformers gives them."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(date_format):
        return datetime.now().strftime(date_format)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)
