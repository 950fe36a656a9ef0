"""Sampling: grammar masks, penalties, the filtered distribution (temperature, top-k, top-p,
min-p), seeded draws, and log-probabilities."""

import torch


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """One token per row of logits [batch, vocab] -> int64 [batch].

    Per row (parameters are [batch] tensors: temperature, top_p, min_p float32; top_k int32;
    seeds, offsets int64): temperature 0 is greedy (argmax, lowest index on ties). Otherwise
    p = softmax(logits / T); keep the top_k most likely (0 = all; ties: lower index first); of
    those the smallest set, most likely first, whose mass reaches top_p (1 = all); drop tokens
    below min_p x the most likely one's probability (0 = off); draw from what is left with the
    Philox generator keyed by (seed, offset), where offset is the index of the output token being
    drawn. The token therefore depends only on the row's logits, parameters, seed and offset: the
    same in any batch, at any row. -inf logits are masked tokens; NaN or +inf are errors (CPU).
    """
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.kvflow.sample(out, logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return out


def rejection_sample(
    logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative decoding's verification of draft tokens against the target's logits.

    Request b owns rows cu_rows[b]..cu_rows[b + 1] - 1 of logits [rows, vocab] (cu_rows int64
    [requests + 1]); with k drafts it has k + 1 rows: row j holds the target's logits after the
    drafts before it, and draft_token_ids[row j] (int64 [rows]) the draft proposed there (the
    last row's entry is ignored). The sampling parameters are one per request, as sample() takes
    them per row. Row j draws its token exactly as sample() would for output index offsets[b] + j;
    a draw equal to the draft accepts it and row j + 1 draws next; any other draw (or the last
    row's) is the request's last token.

    This is the rule of Leviathan et al. for drafts proposed as single tokens (n-gram lookup, a
    greedy draft model; q = 1 at the draft): the draft is accepted with probability p(draft), and
    a rejection's token is distributed as p without the draft, renormalised (the residual
    max(p - q, 0)). Every emitted token is therefore the one sample() draws for its output index
    from the same logits: a seeded request gives the same tokens with and without drafts.

    Returns (out int64 [rows]: request b's emitted tokens from its first row on, -1 after them;
    num_emitted int64 [requests]: its accepted drafts + 1)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    num_emitted = torch.empty(cu_rows.shape[0] - 1 if cu_rows.dim() == 1 else 0, dtype=torch.int64,
                              device=logits.device)
    torch.ops.kvflow.rejection_sample(out, num_emitted, logits, draft_token_ids, cu_rows, temperature, top_k, top_p,
                                      min_p, seeds, offsets)
    return out, num_emitted


def scale_logits(logits: torch.Tensor, divisor: float = 1.0, soft_cap: float | None = None) -> torch.Tensor:
    """In place on float32 logits [batch, vocab]: logits / divisor (Granite's logits_scaling), then
    soft_cap * tanh(logits / soft_cap) when soft_cap is given (Gemma 2's final soft cap). Returns
    logits."""
    torch.ops.kvflow.scale_logits(logits, divisor, soft_cap or 0.0)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int] | torch.Tensor | None = None) -> torch.Tensor:
    """In place on float32 logits [batch, vocab]: structured output's grammar masks. bitmask is
    int32 [mask rows, words], as xgrammar and llguidance fill it: bit b of word w allows token
    32 w + b. Mask row m applies to logits row rows[m] (default: row m, one mask row per logits
    row); every token it does not allow, the tokens past its last word included, becomes -inf.
    Other rows are untouched. rows given as a list is checked on the host before the call.
    Returns logits."""
    if isinstance(rows, (list, tuple)):
        for m, row in enumerate(rows):
            if not 0 <= row < logits.shape[0]:
                raise ValueError(f"apply_token_bitmask: rows[{m}] = {row} is not a logits row in [0, {logits.shape[0]})")
        rows = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    torch.ops.kvflow.apply_token_bitmask(logits, bitmask, rows)
    return logits


def apply_sampling_filters(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """In place on float32 logits [batch, vocab]: the distribution sample() draws from, as logits.

    Kept tokens become logits / T, the rest -inf (greedy rows keep only the argmax), so
    log_softmax of the result is the processed log-probability. Returns logits.
    """
    torch.ops.kvflow.apply_sampling_filters(logits, temperature, top_k, top_p, min_p)
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    prompt_offsets: torch.Tensor,
    output_token_ids: torch.Tensor,
    output_offsets: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """In place on float32 logits [batch, vocab], as Hugging Face and vLLM define them.

    Row b's prompt tokens are prompt_token_ids[prompt_offsets[b]:prompt_offsets[b + 1]] (int64,
    packed), its output tokens likewise. Every distinct token seen in prompt or output: a positive
    logit is divided by repetition_penalty, a negative one multiplied (1 = off). Then every output
    token t with count c: logit -= frequency_penalty * c + presence_penalty. Returns logits.
    """
    torch.ops.kvflow.apply_penalties(logits, prompt_token_ids, prompt_offsets, output_token_ids, output_offsets,
                                     repetition_penalty, frequency_penalty, presence_penalty)
    return logits


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax(logits) at token_ids [batch] -> float32 [batch], and the num_top (<= 20) most
    likely tokens -> (int64 [batch, num_top], float32 [batch, num_top]), most likely first.

    Pass the raw model logits for vLLM's default (before penalties, temperature and filters),
    or the output of apply_sampling_filters for the processed distribution.
    """
    return torch.ops.kvflow.compute_logprobs(logits, token_ids, num_top)


@torch.library.register_fake("kvflow::sample")
def _sample_fake(out, logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return None


@torch.library.register_fake("kvflow::rejection_sample")
def _rejection_sample_fake(out, num_emitted, logits, draft_token_ids, cu_rows, temperature, top_k, top_p, min_p, seeds,
                           offsets):
    return None


@torch.library.register_fake("kvflow::scale_logits")
def _scale_logits_fake(logits, divisor=1.0, soft_cap=0.0):
    return None


@torch.library.register_fake("kvflow::apply_token_bitmask")
def _apply_token_bitmask_fake(logits, bitmask, rows=None):
    return None


@torch.library.register_fake("kvflow::apply_sampling_filters")
def _apply_sampling_filters_fake(logits, temperature, top_k, top_p, min_p):
    return None


@torch.library.register_fake("kvflow::apply_penalties")
def _apply_penalties_fake(logits, prompt_token_ids, prompt_offsets, output_token_ids, output_offsets,
                          repetition_penalty, frequency_penalty, presence_penalty):
    return None


@torch.library.register_fake("kvflow::compute_logprobs")
def _compute_logprobs_fake(logits, token_ids, num_top):
    batch = logits.shape[0]
    return (logits.new_empty((batch,), dtype=torch.float32),
            logits.new_empty((batch, num_top), dtype=torch.int64),
            logits.new_empty((batch, num_top), dtype=torch.float32))
