"""Structured output on the embedded model: every constraint kind gives output that follows it
(a JSON schema's instance, any JSON object, a regex's full match, one of the choices, an EBNF
grammar's sentence) and ends with finish_reason "stop" when the grammar is complete; sampled and
parallel samples too (each with its own matcher); unconstrained requests in the same batch are
untouched; the matcher's state survives preemption and is released on finish and abort; the
replayed CPU program and the op-by-op path agree; bad constraints are the request's own error."""

import json
import re

import pytest

from kvflow import LLM, SamplingParams, StructuredOutputsParams
from kvflow.engine.sampling_params import SamplingParamsError

KV_BYTES_PER_TOKEN = 23_040  # SmolLM2-135M in bf16: 2 x 30 layers x 3 kv heads x 64 x 2 bytes

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def follows_person_schema(text: str) -> bool:
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["name"], str)
            and len(value["name"]) <= 20 and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and 0 <= value["age"] <= 120 and value["city"] in ("Paris", "Berlin", "Tokyo"))


@pytest.fixture(scope="module")
def llm():
    """float32 activations, so that a batch's rows cannot differ by rounding alone."""
    return LLM(dtype="float32", kv_cache_memory=1 << 28, max_model_len=512)


def generate(llm, prompt, structured, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 80)
    return llm.generate([prompt], SamplingParams(structured_outputs=structured, **params), use_tqdm=False)[0]


def test_a_json_schema_gives_an_instance_of_it(llm):
    out = generate(llm, "Describe a person as JSON.", StructuredOutputsParams(json=PERSON)).outputs[0]
    assert out.finish_reason == "stop" and follows_person_schema(out.text), out.text


def test_sampled_parallel_samples_each_follow_the_schema_with_their_own_matcher(llm):
    outputs = generate(llm, "A person:", StructuredOutputsParams(json=json.dumps(PERSON)), temperature=1.0, n=4,
                       seed=7, max_tokens=120).outputs
    assert len(outputs) == 4 and len({o.text for o in outputs}) > 1  # they went different ways
    for out in outputs:
        assert out.finish_reason == "stop" and follows_person_schema(out.text), out.text


def test_json_object_gives_an_object(llm):
    out = generate(llm, "Describe a person as JSON with a name and an age.", StructuredOutputsParams(json_object=True),
                   max_tokens=120).outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_regex_is_matched_whole(llm, temperature):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    out = generate(llm, "Call me at", StructuredOutputsParams(regex=pattern), temperature=temperature,
                   seed=3).outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_a_choice_gives_one_of_the_choices(llm, temperature):
    choices = ["positive", "negative", "it is \"mixed\"\n"]
    for seed in range(3):
        out = generate(llm, "The review 'I loved it' is", StructuredOutputsParams(choice=choices),
                       temperature=temperature, seed=seed).outputs[0]
        assert out.finish_reason == "stop" and out.text in choices, out.text


def test_an_ebnf_grammar_gives_one_of_its_sentences(llm):
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30} "."'
    out = generate(llm, "Is the sky blue?", StructuredOutputsParams(grammar=grammar)).outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.", out.text), out.text


def test_max_tokens_before_the_grammar_completes_ends_with_length(llm):
    out = generate(llm, "Describe a person as JSON.", StructuredOutputsParams(json=PERSON), max_tokens=4).outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.text.startswith("{")


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea.", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON))
    mixed = llm.generate(prompts + ["A person:", "Another person:"], [plain] * 3 + [constrained] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert all(follows_person_schema(o.outputs[0].text) for o in mixed[3:])


def test_the_matcher_survives_preemption_and_the_tokens_are_the_same():
    """Eight requests of up to 200 tokens each (200 letters) in a 20-block pool: most are
    preempted and recomputed; each output still matches the regex whole and equals what a
    roomy pool gives."""
    pattern = "[a-z]{200}"
    prompts = [f"Request {i}: write letters." for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=250, structured_outputs=StructuredOutputsParams(regex=pattern))
    roomy = LLM(kv_cache_memory=1 << 27, max_model_len=272).generate(prompts, params, use_tqdm=False)
    small_llm = LLM(kv_cache_memory=20 * 16 * KV_BYTES_PER_TOKEN, max_model_len=272)
    small = small_llm.generate(prompts, params, use_tqdm=False)
    assert small_llm.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, small):
        assert re.fullmatch(pattern, b.outputs[0].text) and b.outputs[0].finish_reason == "stop"
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_the_program_path_and_the_op_by_op_path_agree():
    prompts = ["A person:", "Describe someone from Tokyo as JSON.", "Give me JSON."]
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PERSON))
    results = []
    for eager in (False, True):
        llm = LLM(kv_cache_memory=1 << 27, max_model_len=256, enforce_eager=eager)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if not eager:
            assert llm.engine.runner.cpu_programs.replays > 10
    assert results[0] == results[1]


def test_matchers_are_released_on_finish_and_abort(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, n=2, structured_outputs=StructuredOutputsParams(json=PERSON))
    engine.add_request("kept", "A person:", params)
    engine.add_request("aborted", "Another person:", params)
    samples = {rid: [s.seq for s in engine._requests[rid].samples] for rid in ("kept", "aborted")}
    assert all(seq.grammar is not None for seqs in samples.values() for seq in seqs)
    assert samples["kept"][0].grammar is not samples["kept"][1].grammar
    for _ in range(3):
        engine.step()
    engine.abort_request("aborted")
    assert all(seq.grammar is None for seq in samples["aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    assert all(seq.grammar is None and seq.status.value == "stop" for seq in samples["kept"])


@pytest.mark.parametrize("make,field", [
    (lambda: StructuredOutputsParams(json=PERSON, regex="a+"), "structured_outputs"),
    (lambda: StructuredOutputsParams(), "structured_outputs"),
    (lambda: StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
    (lambda: StructuredOutputsParams(json=[1, 2]), "structured_outputs.json"),
    (lambda: StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
    (lambda: StructuredOutputsParams(choice=["a", 3]), "structured_outputs.choice"),
    (lambda: StructuredOutputsParams(regex=""), "structured_outputs.regex"),
    (lambda: StructuredOutputsParams(json_object="yes"), "structured_outputs.json_object"),
    (lambda: SamplingParams(structured_outputs={"json": PERSON}), "structured_outputs"),
])
def test_malformed_constraints_are_refused_naming_the_field(make, field):
    with pytest.raises(SamplingParamsError) as error:
        make()
    assert error.value.field == field


@pytest.mark.parametrize("structured,field", [
    (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
])
def test_a_constraint_that_cannot_compile_is_the_requests_error_and_the_engine_goes_on(llm, structured, field):
    with pytest.raises(SamplingParamsError) as error:
        llm.engine.add_request("bad", "Hello", SamplingParams(structured_outputs=structured))
    assert error.value.field == field
    assert not llm.engine.has_unfinished_requests()
    out = generate(llm, "Describe a person as JSON.", StructuredOutputsParams(json=PERSON)).outputs[0]
    assert follows_person_schema(out.text)
