"""Sampling against plain-PyTorch references: greedy is argmax; draws follow the filtered,
renormalised distribution (statistically) and never leave it; a seeded row draws the same token
wherever it sits in a batch; penalties and logprobs match a few lines of float64 PyTorch."""

import math

import pytest
import torch

from kvflow import ops


def params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, device="cpu"):
    def full(value, dtype):
        return torch.full((batch,), value, dtype=dtype, device=device)

    return (full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
            full(min_p, torch.float32))


def reference_distribution(logits, temperature, top_k, top_p, min_p):
    """The filtered, renormalised distribution over one row [vocab], in float64, by sorting."""
    x = logits.double()
    order = torch.sort(x, descending=True, stable=True).indices  # ties: lower index first
    if 0 < top_k < x.numel():
        order = order[:top_k]
    p = torch.softmax(x[order] / temperature, dim=0)
    if top_p < 1.0:
        before = torch.cumsum(p, 0) - p  # mass strictly before each token
        keep = before < top_p
        order, p = order[keep], p[keep]
    if min_p > 0.0:
        keep = p >= min_p * p[0]
        order, p = order[keep], p[keep]
    dist = torch.zeros_like(x)
    dist[order] = p / p.sum()
    return dist


def tv_bound(support, draws, delta=1e-6):
    """A bound that the total-variation distance between the empirical frequencies of `draws`
    samples and the true distribution exceeds with probability < delta. E|f_i - p_i| <=
    sqrt(p_i / n), so E[TV] <= 1/2 sum_i sqrt(p_i / n) <= 1/2 sqrt(support / n) (Cauchy-Schwarz);
    one sample moves TV by at most 1/n, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2),
    i.e. t = sqrt(ln(1/delta) / (2 n))."""
    return 0.5 * math.sqrt(support / draws) + math.sqrt(math.log(1 / delta) / (2 * draws))


def draw_many(logits_row, n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234):
    """n independent draws: the same row n times, output offsets 0 .. n - 1."""
    device = logits_row.device
    logits = logits_row.expand(n, -1).contiguous()
    offsets = torch.arange(n, dtype=torch.int64, device=device)
    seeds = torch.full((n,), seed, dtype=torch.int64, device=device)
    return ops.sample(logits, *params(n, temperature, top_k, top_p, min_p, device), seeds, offsets)


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, top_k=50, top_p=0.9),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_p=1e-6),
    dict(temperature=1.0, min_p=0.99),
    dict(temperature=2.0, top_k=200, top_p=0.5, min_p=0.01),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_the_filtered_distribution(device, case, dtype):
    torch.manual_seed(0)
    vocab, n = 1001, 20000  # an odd vocabulary
    row = (torch.randn(vocab) * 2).to(dtype)
    row[::7] = float("-inf")  # masked tokens
    expected = reference_distribution(row.float(), case["temperature"], case.get("top_k", 0), case.get("top_p", 1.0),
                                      case.get("min_p", 0.0))
    tokens = draw_many(row.to(device), n, **case).cpu()
    counts = torch.bincount(tokens, minlength=vocab).double()
    support = int((expected > 0).sum())
    assert counts[expected == 0].sum() == 0, "drew a token outside the top-k / top-p / min-p set"
    tv = 0.5 * (counts / n - expected).abs().sum().item()
    assert tv < tv_bound(support, n), f"TV distance {tv:.4f} over support {support}"


def test_all_equal_logits_and_ties(device):
    vocab = 64
    row = torch.zeros(vocab, device=device)
    tokens = draw_many(row, 8000, top_p=0.25).cpu()
    # Equal probabilities: the top-p set is the lowest indices first, 16 of them.
    assert tokens.max() < 16 and len(tokens.unique()) == 16
    tokens = draw_many(row, 4000, top_k=5).cpu()
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4}


def test_greedy_is_argmax_with_lowest_index_on_ties(device):
    torch.manual_seed(1)
    logits = torch.randn(37, 4097, device=device)
    logits[3, 100] = logits[3, 2000] = logits[3].max() + 1  # a tie: the lower index wins
    seeds = torch.arange(37, device=device)
    offsets = torch.zeros(37, dtype=torch.int64, device=device)
    tokens = ops.sample(logits, *params(37, temperature=0.0, top_k=5, top_p=0.3, device=device), seeds, offsets)
    expected = logits.argmax(-1)
    assert expected[3] == 100
    assert torch.equal(tokens, expected)


def test_a_row_draws_the_same_token_anywhere_in_the_batch(device):
    torch.manual_seed(2)
    vocab = 49152
    row = torch.randn(vocab, device=device) * 3
    others = torch.randn(63, vocab, device=device) * 3
    other_params = [torch.rand(63, device=device) + 0.2, torch.randint(0, 100, (63,), dtype=torch.int32, device=device),
                    torch.rand(63, device=device) * 0.9 + 0.1, torch.rand(63, device=device) * 0.1]
    mine = [torch.tensor([v], device=device) for v in (0.9, 40, 0.8, 0.02)]
    mine[1] = mine[1].int()
    for offset in range(5):
        alone = ops.sample(row[None], *mine, torch.tensor([77], device=device),
                           torch.tensor([offset], device=device))
        for position in (0, 63):
            logits = torch.cat([others[:position], row[None], others[position:]])
            batch_params = [torch.cat([p[:position], m, p[position:]]) for p, m in zip(other_params, mine)]
            seeds = torch.arange(64, device=device)
            seeds[position] = 77
            offsets = torch.full((64,), 9, dtype=torch.int64, device=device)
            offsets[position] = offset
            tokens = ops.sample(logits, *batch_params, seeds, offsets)
            assert tokens[position] == alone[0]


def test_apply_sampling_filters_matches_the_distribution(device):
    torch.manual_seed(3)
    logits = torch.randn(3, 500, device=device)
    t, k, p, m = (torch.tensor([0.7, 1.0, 0.0], device=device), torch.tensor([20, 0, 0], dtype=torch.int32, device=device),
                  torch.tensor([0.8, 0.5, 1.0], device=device), torch.tensor([0.0, 0.1, 0.0], device=device))
    filtered = ops.apply_sampling_filters(logits.clone(), t, k, p, m)
    for b in range(2):
        expected = reference_distribution(logits[b].cpu(), t[b].item(), k[b].item(), p[b].item(), m[b].item())
        torch.testing.assert_close(torch.softmax(filtered[b].double(), 0).cpu(), expected, rtol=1e-5, atol=1e-6)
    assert torch.isinf(filtered[2]).sum() == 499 and filtered[2].argmax() == logits[2].argmax()


def reference_penalties(logits, prompts, outputs, rep, freq, pres):
    out = logits.clone().double()
    for b, (prompt, output) in enumerate(zip(prompts, outputs)):
        seen = set(prompt) | set(output)
        for t in seen:
            out[b, t] = out[b, t] / rep[b] if out[b, t] > 0 else out[b, t] * rep[b]
        for t in set(output):
            out[b, t] -= freq[b] * output.count(t) + pres[b]
    return out.float()


def packed(lists, device):
    ids = torch.tensor([t for ts in lists for t in ts], dtype=torch.int64, device=device)
    offsets = torch.tensor([0] + list(torch.tensor([len(ts) for ts in lists]).cumsum(0)), dtype=torch.int64,
                           device=device)
    return ids, offsets


def test_apply_penalties(device):
    torch.manual_seed(4)
    logits = torch.randn(3, 97, device=device) * 3
    prompts = [[1, 5, 5, 9], [], [2, 3]]
    outputs = [[5, 7, 7, 7], [4, 4], []]
    rep, freq, pres = [1.3, 0.8, 2.0], [0.5, 0.1, 1.0], [0.25, 1.0, 0.5]
    expected = reference_penalties(logits.cpu(), prompts, outputs, rep, freq, pres)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    ops.apply_penalties(logits, *packed(prompts, device), *packed(outputs, device), f32(rep), f32(freq), f32(pres))
    torch.testing.assert_close(logits.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_logprobs(device, dtype):
    torch.manual_seed(5)
    logits = (torch.randn(6, 777) * 4).to(dtype).to(device)
    tokens = torch.randint(0, 777, (6,), device=device)
    chosen, top_ids, top_lp = ops.compute_logprobs(logits, tokens, 20)
    reference = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(chosen.double(), reference.gather(1, tokens[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    values, indices = torch.sort(reference, dim=-1, descending=True, stable=True)  # ties: lower index first
    values, indices = values[:, :20], indices[:, :20]
    assert torch.equal(top_ids, indices)
    torch.testing.assert_close(top_lp.double(), values, rtol=1e-5, atol=1e-5)
    empty = ops.compute_logprobs(logits, tokens, 0)
    assert empty[1].shape == (6, 0)
    masked = torch.full((1, 9), float("-inf"), device=device)
    masked[0, 4] = masked[0, 7] = 1.0
    _, ids, lps = ops.compute_logprobs(masked, torch.tensor([4], device=device), 4)
    assert ids.tolist() == [[4, 7, 0, 1]]  # the two finite tokens, then -inf ones by index
    assert torch.isinf(lps[0, 2:]).all()


def test_bad_input_is_rejected_clearly():
    logits = torch.randn(2, 10)
    seeds, offsets = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)

    def call(logits=logits, **kw):
        return ops.sample(logits, *params(2, **kw), seeds, offsets)

    with pytest.raises(RuntimeError, match=r"temperature\[0\] = -1 must be finite and >= 0"):
        call(temperature=-1.0)
    with pytest.raises(RuntimeError, match=r"top_p\[0\] = 0 must be in \(0, 1\]"):
        call(top_p=0.0)
    with pytest.raises(RuntimeError, match=r"top_p\[0\] = 1.5 must be in \(0, 1\]"):
        call(top_p=1.5)
    with pytest.raises(RuntimeError, match=r"top_k\[0\] = -1 must be >= 0"):
        call(top_k=-1)
    with pytest.raises(RuntimeError, match=r"min_p\[0\] = 1.5 must be in \[0, 1\]"):
        call(min_p=1.5)
    bad = logits.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match=r"logits\[1, 3\] is nan: logits must be finite or -inf"):
        call(bad)
    bad[1, 3] = float("inf")
    with pytest.raises(RuntimeError, match=r"logits\[1, 3\] is inf"):
        call(bad)
    with pytest.raises(RuntimeError, match="has no finite logit"):
        call(torch.full((2, 10), float("-inf")))
    with pytest.raises(RuntimeError, match="top_k must be Int"):
        ops.sample(logits, params(2)[0], torch.zeros(2, dtype=torch.int64), *params(2)[2:], seeds, offsets)
    with pytest.raises(RuntimeError, match=r"temperature must be \[2\]"):
        ops.sample(logits, torch.ones(3), *params(2)[1:], seeds, offsets)
    before = logits.clone()
    with pytest.raises(RuntimeError, match=r"output_token_ids\[1\] = 10 is not a token id"):
        ops.apply_penalties(logits, *packed([[1], []], "cpu"), *packed([[2], [10]], "cpu"), torch.full((2,), 2.0),
                            torch.ones(2), torch.ones(2))
    assert torch.equal(logits, before)
    # A bad second row fails the whole call before the first row is filtered.
    bad = logits.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match=r"logits\[1, 3\] is nan"):
        ops.apply_sampling_filters(bad, *params(2, temperature=0.5, top_k=2))
    assert torch.equal(bad[0], logits[0])
