"""Greedy decoding as the reference engine does it, and the comparison of an engine's greedy
output with it: the same tokens up to the first step where the reference's top two are nearly
tied, and the same log-probabilities there."""

import torch

LOGPROB_ATOL = 1e-3
NEAR_TIE = 1e-3  # a greedy choice may differ only where the reference's own top two are this close


def transformers_greedy(model, ids: list[int], steps: int, top: int,
                        device: str = "cpu") -> tuple[list[int], list[dict[int, float]], list[float]]:
    """Greedy tokens, each step's top logprobs and its top-2 margin, recomputing the whole
    sequence each step (no cache to differ in)."""
    tokens, tops, margins = [], [], []
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([sequence], device=device)).logits[0, -1].float()
            values, indices = torch.log_softmax(logits, -1).topk(top)
            tops.append(dict(zip(indices.tolist(), values.tolist())))
            margins.append(float(values[0] - values[1]))
            tokens.append(int(indices[0]))
            sequence.append(tokens[-1])
    return tokens, tops, margins


def assert_greedy_matches(output, reference: tuple[list[int], list[dict[int, float]], list[float]],
                          label: str = "") -> None:
    """output (a RequestOutput) took the reference's tokens up to the first near tie, and its
    logprobs are the reference's at those steps (a token the output does not list may only be one
    tied at the reference's last listed place)."""
    tokens, tops, margins = reference
    ours = output.outputs[0]
    for step, (want, top, margin) in enumerate(zip(tokens, tops, margins)):
        got = ours.token_ids[step]
        if got != want:
            assert margin < NEAR_TIE, f"{label}step {step} gave {got}, the reference {want} (margin {margin:.2e})"
            break  # the sequences part here; what follows is conditioned on different tokens
        boundary = min(top.values())
        for token, logprob in top.items():
            if token not in ours.logprobs[step]:
                assert logprob - boundary < LOGPROB_ATOL, (label, step, token)
                continue
            assert abs(ours.logprobs[step][token] - logprob) < LOGPROB_ATOL, (label, step, token)
