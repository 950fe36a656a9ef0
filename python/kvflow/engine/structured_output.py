"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, a choice of
strings, an EBNF grammar) compiled by xgrammar against the model's tokenizer, and one grammar
matcher per sample that says, step by step, which tokens may come next.

The engine compiles at add_request (a bad schema is the request's error, not the step's), the
runner asks each constrained row's matcher for its token bitmask before sampling and applies it
with the apply_token_bitmask op, and the engine advances the matcher with every token it
accepts; a matcher that has accepted a stop token ends its sample (finish_reason "stop").
xgrammar was chosen by measurement (docs/benchmarks.md, "Grammar engines")."""

import torch

from kvflow.engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from kvflow.tokenizer import Tokenizer

ANY_OBJECT = '{"type": "object", "additionalProperties": true}'  # json_object: any object, nested values too


def _ebnf_string(text: str) -> str:
    """text as an EBNF string literal: quotes and backslashes escaped, control characters as \\uXXXX."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


class GrammarMatcher:
    """One sample's position in its grammar: which tokens may come next (fill_bitmask), and the
    tokens accepted so far (accept)."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into row `row` of an int32 bitmask [rows, words]."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False (the state unchanged) where the grammar forbids it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, count: int) -> None:
        """Undoes the last count accepted tokens."""
        if count:
            self._matcher.rollback(count)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of token_ids, in order, the grammar allows from here: up to the first it
        forbids, and none after one that completes it (a stop token). The state is unchanged."""
        count = 0
        for token in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            count += 1
        if count:
            self._matcher.rollback(count)
        return count

    def fill_bitmasks_along(self, token_ids: list[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Speculative rows: row first_row + j of bitmask gets the tokens allowed after
        token_ids[:j], for j = 0 .. len(token_ids), with token_ids a valid prefix (valid_prefix).
        Rows after one that completes the grammar are left as they are: whatever is drawn there
        is dropped, as the sample ends at its stop token. The state is unchanged."""
        self._matcher.fill_next_token_bitmask(bitmask, first_row)
        accepted = 0
        for j, token in enumerate(token_ids, start=1):
            if not self._matcher.accept_token(token):
                if accepted:
                    self._matcher.rollback(accepted)
                raise ValueError(f"draft token {token} at position {j - 1} is not allowed by the request's grammar")
            accepted += 1
            if self._matcher.is_terminated():
                break
            self._matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if accepted:
            self._matcher.rollback(accepted)

    @property
    def finished(self) -> bool:
        """The grammar is complete and a stop token was accepted: the sample ends here."""
        return self._matcher.is_terminated()


class StructuredOutputCompiler:
    """Compiles constraints against one model's tokenizer (xgrammar keeps the compiled grammars of
    schemas it has seen, so a repeated schema compiles once) and makes matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """vocab_size: the width of the model's logits, which may exceed the tokenizer's
        vocabulary (padded embeddings); tokens past the tokenizer's are never allowed."""
        try:
            import xgrammar
        except ImportError as error:
            raise RuntimeError("structured output needs xgrammar: `pip install --no-deps xgrammar==0.2.9 "
                               f"apache-tvm-ffi transformers` ({error})") from None
        self._xgrammar = xgrammar
        self.vocab_size = vocab_size
        stop = sorted(tokenizer.stop_token_ids)
        backend = getattr(tokenizer._backend, "tokenizer", None)
        if backend is not None:  # a tokenizers.Tokenizer
            import transformers

            fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
            info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stop)
        else:  # SentencePiece: pieces with its word marker and <0xXX> byte tokens
            pieces = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
            info = xgrammar.TokenizerInfo(pieces, vocab_type=xgrammar.VocabType.BYTE_FALLBACK, vocab_size=vocab_size,
                                          stop_token_ids=stop, add_prefix_space=True)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of a request's constraint; SamplingParamsError naming the field
        where xgrammar refuses it (an unsupported schema keyword, a bad regex or grammar)."""
        kind, value = params.kind, params._key[1] if len(params._key) > 1 else None
        try:
            # JSON laid out as json.dumps lays it out: with any whitespace allowed, a small model
            # can spend its whole max_tokens on blanks between two tokens.
            if kind == "json":
                return self._compiler.compile_json_schema(value, any_whitespace=False)
            if kind == "json_object":
                return self._compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "choice":
                return self._compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in value))
            return self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError) as error:
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise SamplingParamsError(f"structured_outputs.{kind}", f"cannot be compiled: {message}") from None

    def matcher(self, compiled) -> GrammarMatcher:
        return GrammarMatcher(self._xgrammar.GrammarMatcher(compiled))
