"""The engine end to end on a checkpoint made at test time, so that a GPU machine without the
embedded model runs it too: a random Llama of small shapes saved by transformers beside a
byte-level BPE tokenizer trained here on a few sentences. Greedy tokens and log-probabilities
against transformers on the same device (eagerly and through decode CUDA graphs, and in a KV pool
small enough to preempt); n-gram speculative decoding against the plain engine; every KV block
free after each run. The CPU cases check the test itself; the CUDA ones (scripts/gpu_check.sh
selects them by name) need a GPU."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from greedy_reference import assert_greedy_matches, transformers_greedy
from kvflow import LLM, SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

TEXT = """The first public libraries lent books for free to anyone who lived in the town.
Readers signed a ledger, took one volume home for two weeks, and paid a small fine if late.
def area(width, height):
    return width * height
Glaciers move because ice under great pressure behaves like a very thick liquid.
Sourdough starter is a mix of flour and water in which wild yeast and bacteria live together."""
PROMPTS = ["The first public libraries lent books", "def area(width, height):\n    return",
           "Glaciers move because ice under great pressure behaves like a very thick liquid. Glaciers move",
           "Sourdough starter is a mix of flour and water. Sourdough starter is a mix of"]
STEPS = 24
TOP = 5
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x (K, V) x kv heads x head_dim x float32


def save_checkpoint(directory, cycling: bool):
    """A directory transformers and kvflow both load: weights, config and tokenizer. Random
    weights, or (cycling) an embedding much larger than the layers' weights and an LM head whose
    row CYCLE[x] is token x's embedding, so that greedy decoding follows x -> CYCLE[x], round
    cycles of 6 tokens: the n-gram drafts of such a loop get accepted, where the random model's
    are nearly all rejected."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXT.splitlines(), trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.02 if cycling else 0.1)
        if cycling:
            embedding = model.model.embed_tokens.weight
            embedding.normal_(0.0, 1.0)
            model.lm_head.weight[cycle(config.vocab_size)] = embedding
    model.save_pretrained(directory)
    return directory, model.eval(), tokenizer


def cycle(vocab_size: int) -> torch.Tensor:
    """CYCLE: a permutation of the vocabulary made of cycles of 6 tokens (and one shorter)."""
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1))
    successor = torch.empty_like(order)
    for start in range(0, vocab_size, 6):
        members = order[start:start + 6]
        successor[members] = members.roll(-1)
    return successor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("random-llama"), cycling=False)


@pytest.fixture(scope="module")
def cycling_checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("cycling-llama"), cycling=True)


def generate(llm: LLM, prompts, params: SamplingParams) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.allocator.num_used_blocks == 0, "blocks left in use after every request finished"
    return outputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graphs", "preempting"])
def test_greedy_decoding_matches_transformers_on_the_same_device(checkpoint, device, mode):
    directory, model, tokenizer = checkpoint
    reference_model = model.to(device)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    references = [transformers_greedy(reference_model, ids, STEPS, TOP, device) for ids in prompts]
    model.to("cpu")
    # The preempting pool holds 10 blocks of 16 tokens; the four requests need 14 together.
    kv_cache_memory = 10 * 16 * KV_BYTES_PER_TOKEN if mode == "preempting" else 8 << 20
    llm = LLM(model=str(directory), device=device, dtype="float32", kv_cache_memory=kv_cache_memory,
              max_num_seqs=4, enforce_eager=mode != "graphs")
    if device == "cuda":
        assert (llm.engine.runner.decode_graphs is not None) == (mode == "graphs")
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=TOP, ignore_eos=True)
    for i, (output, reference) in enumerate(zip(generate(llm, prompts, params), references)):
        assert_greedy_matches(output, reference, f"prompt {i}: ")
    if mode == "preempting":
        assert llm.engine.stats()["preemptions"] > 0, "the pool was meant to preempt"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["random", "cycling"])
def test_ngram_speculation_gives_the_plain_engines_greedy_tokens(checkpoint, cycling_checkpoint, device, model):
    """Drafts verified in one step by the rejection sampler: the plain engine's tokens and
    logprobs up to its first near tie, and every block returned; the random model's drafts
    mostly rejected, the cycling model's mostly accepted, several a step."""
    directory, _, tokenizer = checkpoint if model == "random" else cycling_checkpoint
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=2, ignore_eos=True)
    options = dict(model=str(directory), device=device, dtype="float32", kv_cache_memory=8 << 20, max_num_seqs=4)
    plain = generate(LLM(**options), prompts, params)
    references = []
    for output in plain:
        ours = output.outputs[0]
        margins = [top[0] - top[1] for top in (sorted(step.values(), reverse=True) for step in ours.logprobs)]
        references.append((ours.token_ids, ours.logprobs, margins))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 8}
    llm = LLM(**options, speculative_config=spec)
    for i, (output, reference) in enumerate(zip(generate(llm, prompts, params), references)):
        assert_greedy_matches(output, reference, f"prompt {i}: ")
    stats = llm.engine.stats()["spec_decode"]
    if model == "random":
        assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] * 2, stats
    else:
        assert stats["num_accepted_tokens"] > stats["num_draft_tokens"] * 0.8 > 0, stats
        assert stats["accepted_per_position"][-1] > 0, stats
