"""rejection_sample, speculative decoding's verification, against float64 PyTorch references: the
emitted tokens follow the target's filtered distribution at every position (a draft accepted
with probability p(draft), a rejection's token drawn from p without the draft), greedy rows accept
exactly while the draft is the argmax, and every emitted token is the one sample() draws for its
output index, so drafts never change a seeded request's tokens. Bad input is refused before
anything is written."""

import math

import pytest
import torch

from kvflow import ops


def reference_distribution(logits, temperature=1.0, top_k=0):
    """The target's distribution over one row, in float64 (temperature and top-k; ties: lower index)."""
    x = logits.double()
    order = torch.sort(x, descending=True, stable=True).indices
    if 0 < top_k < x.numel():
        order = order[:top_k]
    dist = torch.zeros_like(x)
    dist[order] = torch.softmax(x[order] / temperature, dim=0)
    return dist


def tv_bound(support, draws, delta=1e-6):
    """As tests/test_sampling.py derives it: E[TV] <= 1/2 sqrt(support / n), plus McDiarmid's
    deviation sqrt(ln(1/delta) / (2 n))."""
    return 0.5 * math.sqrt(support / draws) + math.sqrt(math.log(1 / delta) / (2 * draws))


def total_variation(tokens, expected):
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    return 0.5 * (counts / tokens.numel() - expected).abs().sum().item()


def request_params(n, temperature=1.0, top_k=0, device="cpu"):
    def full(value, dtype):
        return torch.full((n,), value, dtype=dtype, device=device)

    return full(temperature, torch.float32), full(top_k, torch.int32), full(1.0, torch.float32), full(0.0, torch.float32)


def verify(logits, drafts, cu_rows, temperature, top_k, seeds, offsets, device):
    n = len(cu_rows) - 1
    return ops.rejection_sample(logits.to(device), torch.tensor(drafts, dtype=torch.int64, device=device),
                                torch.tensor(cu_rows, dtype=torch.int64, device=device),
                                *request_params(n, temperature, top_k, device),
                                torch.as_tensor(seeds, dtype=torch.int64).to(device),
                                torch.as_tensor(offsets, dtype=torch.int64).to(device))


@pytest.mark.parametrize("case", [dict(temperature=1.0), dict(temperature=0.7, top_k=20)], ids=["plain", "top_k"])
def test_emitted_tokens_follow_the_target_distribution(device, case):
    """n requests, each two drafts over the same two rows of target logits, each with its own seed:
    position 0 follows p0 whatever the draft; given the first draft accepted, position 1 follows
    p1; given it rejected, the token follows p0 without the draft (the residual); the draft's
    acceptance rate is p0(draft)."""
    torch.manual_seed(0)
    vocab, n = 97, 20000
    rows = torch.randn(3, vocab) * 1.5
    p0 = reference_distribution(rows[0], **case)
    p1 = reference_distribution(rows[1], **case)
    draft0 = int(torch.argsort(p0, descending=True)[1])  # the second most likely: accepted about p0(draft0)
    draft1 = int(torch.argmax(p1))
    logits = rows.repeat(n, 1)
    drafts = [draft0, draft1, -1] * n
    cu_rows = list(range(0, 3 * n + 1, 3))
    out, emitted = verify(logits, drafts, cu_rows, case.get("temperature"), case.get("top_k", 0),
                          torch.arange(n) * 7919 + 5, torch.zeros(n, dtype=torch.int64), device)
    out, emitted = out.cpu().view(n, 3), emitted.cpu()
    assert ((emitted >= 1) & (emitted <= 3)).all()
    first = out[:, 0]
    support0 = int((p0 > 0).sum())
    assert total_variation(first, p0) < tv_bound(support0, n)
    accepted = first == draft0
    rate, expected_rate = accepted.double().mean().item(), p0[draft0].item()
    assert abs(rate - expected_rate) < math.sqrt(math.log(2e6) / (2 * n)), (rate, expected_rate)  # Hoeffding
    residual = p0.clone()
    residual[draft0] = 0
    residual /= residual.sum()
    rejected = first[~accepted]
    assert total_variation(rejected, residual) < tv_bound(support0, rejected.numel())
    assert (emitted[~accepted] == 1).all() and (out[~accepted, 1:] == -1).all()
    second = out[accepted, 1]
    assert (emitted[accepted] >= 2).all()
    assert total_variation(second, p1) < tv_bound(int((p1 > 0).sum()), second.numel())


def test_every_emitted_token_is_the_one_sample_draws_for_its_index(device):
    """Requests of 1 to 5 rows (0 to 4 drafts), drafts half right: each emitted token equals
    sample() on that row at output index offset + j, with the request's seed."""
    torch.manual_seed(1)
    vocab = 301
    sizes = [1, 3, 5, 2, 4, 1]
    total = sum(sizes)
    logits = torch.randn(total, vocab) * 3
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    offsets = torch.tensor([0, 5, 17, 2, 9, 40])
    row_seeds = torch.repeat_interleave(seeds, torch.tensor(sizes))
    row_offsets = torch.cat([offsets[b] + torch.arange(s) for b, s in enumerate(sizes)])
    own = ops.sample(logits, *request_params(total, 0.9), row_seeds, row_offsets)
    drafts = [int(t) if i % 3 else (int(t) + 1) % vocab for i, t in enumerate(own.tolist())]
    cu_rows = [0]
    for s in sizes:
        cu_rows.append(cu_rows[-1] + s)
    out, emitted = verify(logits, drafts, cu_rows, 0.9, 0, seeds, offsets, device)
    out, emitted = out.cpu(), emitted.cpu()
    for b, s in enumerate(sizes):
        first = cu_rows[b]
        expected = []
        for j in range(s):
            expected.append(int(own[first + j]))
            if j == s - 1 or own[first + j] != drafts[first + j]:
                break
        assert emitted[b] == len(expected)
        assert out[first:first + len(expected)].tolist() == expected
        assert (out[first + len(expected):first + s] == -1).all()


def test_greedy_accepts_while_the_draft_is_the_argmax(device):
    torch.manual_seed(2)
    vocab = 50
    logits = torch.randn(4, vocab)
    best = logits.argmax(dim=1).tolist()
    for wrong_at in range(4):
        drafts = [best[j] if j != wrong_at else (best[j] + 1) % vocab for j in range(3)] + [-1]
        out, emitted = verify(logits, drafts, [0, 4], 0.0, 0, [0], [0], device)
        keep = min(wrong_at, 3) + 1
        assert emitted.cpu().tolist() == [keep]
        assert out.cpu().tolist() == best[:keep] + [-1] * (4 - keep)


def test_bad_input_is_refused_before_anything_is_written():
    logits = torch.randn(4, 10)
    good = dict(drafts=[1, 2, 3, -1], cu_rows=[0, 1, 4])

    def run(drafts, cu_rows, temperature=1.0):
        n = len(cu_rows) - 1
        out = torch.full((4,), 7, dtype=torch.int64)
        emitted = torch.full((max(n, 0),), 7, dtype=torch.int64)
        with pytest.raises(RuntimeError) as error:
            torch.ops.kvflow.rejection_sample(out, emitted, logits, torch.tensor(drafts), torch.tensor(cu_rows),
                                              *request_params(n, temperature), torch.zeros(n, dtype=torch.int64),
                                              torch.zeros(n, dtype=torch.int64))
        assert (out == 7).all() and (emitted == 7).all()
        return str(error.value)

    assert "cu_rows must run from 0 to 4" in run(good["drafts"], [0, 1, 3])
    assert "request 1 has no row" in run(good["drafts"], [0, 4, 4])
    assert "draft_token_ids[2] = 10" in run([1, 2, 10, -1], good["cu_rows"])
    assert "draft_token_ids[0] = -3" in run([-3, 2, 3, -1], [0, 2, 4])
    assert "temperature[0] = -1" in run(good["drafts"], good["cu_rows"], temperature=-1.0)
    assert "draft_token_ids must be [4]" in run([1, 2, 3], good["cu_rows"])
    with pytest.raises(RuntimeError, match=r"seeds must be \[2\] \(one value per request\)"):
        ops.rejection_sample(logits, torch.tensor(good["drafts"]), torch.tensor(good["cu_rows"]), *request_params(2),
                             torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    nan = logits.clone()
    nan[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match=r"logits\[3, 5\] is nan"):
        ops.rejection_sample(nan, torch.tensor(good["drafts"]), torch.tensor(good["cu_rows"]), *request_params(2),
                             torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
