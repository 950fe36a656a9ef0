"""apply_token_bitmask, structured output's grammar masks on the logits, against plain PyTorch
written from the bit layout (bit t % 32 of word t / 32 allows token t), on every CPU instruction
set and CUDA: every row or some rows (the others untouched), masks narrower and wider than the
vocabulary, strided rows; the masks xgrammar fills for a JSON schema; bad input refused by name."""

import pytest
import torch

from kvflow import ops


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [mask rows, vocab] from the words, one bit at a time; tokens past the words: False."""
    bits = (bitmask.long()[:, :, None] >> torch.arange(32)) & 1  # [rows, words, 32]
    flat = bits.reshape(bitmask.shape[0], -1).bool()
    allowed = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    n = min(vocab, flat.shape[1])
    allowed[:, :n] = flat[:, :n]
    return allowed


def reference(logits, bitmask, rows):
    expected = logits.clone()
    rows = range(logits.shape[0]) if rows is None else rows
    allowed = allowed_tokens(bitmask, logits.shape[1])
    for m, row in enumerate(rows):
        expected[row][~allowed[m]] = float("-inf")
    return expected


def random_bitmask(rows, words, g, density=0.5):
    """Words of random bits, a few all ones (unconstrained stretches) and all zeros among them."""
    bits = torch.rand(rows, words, 32, generator=g) < density
    bits[:, ::5] = True
    bits[:, 3::7] = False
    packed = (bits.long() << torch.arange(32)).sum(-1)
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32)


@pytest.mark.parametrize("vocab,words", [(49152, 1536), (97, 4), (100, 3), (64, 10), (1, 1)])
@pytest.mark.parametrize("rows", [None, [2], [3, 0]])
def test_masks_match_the_bit_layout(device, vocab, words, rows):
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(4, vocab, generator=g)
    bitmask = random_bitmask(4 if rows is None else len(rows), words, g)
    expected = reference(logits, bitmask, rows)
    out = ops.apply_token_bitmask(logits.to(device), bitmask.to(device), rows)
    assert torch.equal(out.cpu(), expected)


def test_rows_as_a_tensor_and_strided_logits_leave_the_rest_alone(device):
    g = torch.Generator().manual_seed(1)
    storage = torch.randn(6, 130, generator=g)
    logits = storage[::2, :100]  # rows 0, 2, 4 of the storage, 100 tokens each
    bitmask = random_bitmask(2, 4, g)
    expected_storage = storage.clone()
    expected_storage[::2, :100] = reference(logits, bitmask, [2, 1])
    on_device = storage.to(device)
    ops.apply_token_bitmask(on_device[::2, :100], bitmask.to(device), torch.tensor([2, 1], device=device))
    assert torch.equal(on_device.cpu(), expected_storage)


def test_a_schema_mask_from_xgrammar_leaves_only_the_tokens_the_grammar_allows():
    """The embedded model's tokenizer and a JSON schema: after applying the first step's mask,
    greedy argmax over any logits is a token the matcher accepts, and a forbidden one has -inf."""
    import transformers
    import xgrammar

    from kvflow.loader.model_loader import resolve_model_path
    from kvflow.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(resolve_model_path(None))
    backend = tokenizer._backend.tokenizer
    vocab = backend.get_vocab_size(with_added_tokens=True)
    info = xgrammar.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=backend),
                                                   vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
        '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = ops.apply_token_bitmask(torch.randn(1, vocab, generator=g), bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token) and matcher.rollback(1) is None
    forbidden = backend.token_to_id("hello")
    assert logits[0, forbidden] == float("-inf")


@pytest.mark.parametrize("call,message", [
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32)),
     "needs float32 logits, got BFloat16"),
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int64)),
     "bitmask must be int32"),
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64), torch.zeros(3, 2, dtype=torch.int32)),
     "3 mask rows for 2 logits rows"),
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int32), [2]),
     r"rows\[0\] = 2 is not a logits row in \[0, 2\)"),
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([-1])),
     r"rows\[0\] = -1 is not a logits row in \[0, 2\)"),
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int32),
                                     torch.tensor([0, 1], dtype=torch.int32)),
     "rows must be int64"),
    (lambda: ops.apply_token_bitmask(torch.randn(2, 64), torch.zeros(2, 4, dtype=torch.int32)[:, ::2]),
     "bitmask must be contiguous"),
])
def test_bad_input_is_refused_by_name_and_nothing_is_written(call, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


def test_a_refused_row_writes_nothing():
    logits = torch.randn(2, 64)
    before = logits.clone()
    with pytest.raises(RuntimeError, match="is not a logits row"):
        ops.apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 5]))
    assert torch.equal(logits, before)
