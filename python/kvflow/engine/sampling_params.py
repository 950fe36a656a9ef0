"""What a request asks of the sampler and of the stop conditions, checked when it is made.

Every field is checked for its type and for the range the kernels represent it in (int32,
int64 or float32, after the conversion), so that a request that is accepted can never fail a
model step for the others in its batch."""

import json
import math
import numbers
from dataclasses import dataclass, field

INT32_MAX = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
MAX_SAMPLES = 128      # n: samples share the prompt, but each holds its own blocks
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5  # below it the logits over the temperature overflow float32; 0 is greedy
# The penalty divides positive logits and multiplies negative ones: within these bounds a logit
# stays finite in float32 however large the model makes it.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
# What LLMEngine.step returns for a request: "cumulative", an output every step it advances
# (everything so far, and the step's delta), for streaming; "final_only", one output, once it has
# finished, for offline generation (LLM.generate), which spares building the others.
OUTPUT_KINDS = ("cumulative", "final_only")


class SamplingParamsError(ValueError):
    """A field of SamplingParams (or of a request) is invalid; `field` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def check_int(name: str, value, low: int, high: int) -> int:
    """value as an int in [low, high], or SamplingParamsError; floats and bools are refused
    rather than rounded."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(name, f"must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise SamplingParamsError(name, f"must be in [{low}, {high}], got {value}")
    return value


def check_float(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """value as a finite float in [low, high] (or (low, high]) once rounded to float32, which is
    what the sampler sees: 1e-46 is 0 there, and 1e39 is infinite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(name, f"must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        raise SamplingParamsError(name, f"must be a finite float32, got {value!r}") from None
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise SamplingParamsError(name, f"must be a finite float32, got {value!r}")
    if value != 0 and abs(value) < FLOAT32_TINY:
        raise SamplingParamsError(name, f"{value!r} is too small for float32 (it would be 0 in the sampler)")
    if value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise SamplingParamsError(name, f"must be in {interval}, got {value!r}")
    return value


def check_text(name: str, value: str) -> str:
    """value as text that encodes as UTF-8 (a lone surrogate does not)."""
    if not isinstance(value, str):
        raise SamplingParamsError(name, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SamplingParamsError(name, f"is not valid Unicode text ({error.reason} at {error.start})") from None
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"must be true or false, got {type(value).__name__} {value!r}")
    return value


# Structured output's constraints, as vLLM names them.
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, as vLLM's StructuredOutputsParams names them: json (a JSON schema,
    as a dict or its text), json_object (any JSON object), regex, choice (the output is one of
    these strings), grammar (EBNF, as xgrammar reads it: `root ::= ...`, or an xgrammar.Grammar)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    _key: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        name = "structured_outputs"
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(f"{name}.json_object", f"must be true or false, got {self.json_object!r}")
        given = [kind for kind in CONSTRAINT_KINDS
                 if (getattr(self, kind) is True if kind == "json_object" else getattr(self, kind) is not None)]
        if len(given) != 1:
            raise SamplingParamsError(name, f"must set exactly one of {', '.join(CONSTRAINT_KINDS)}; got "
                                            f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as error:
                    raise SamplingParamsError(f"{name}.json", f"is not valid JSON: {error}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError(f"{name}.json", f"must be a JSON schema (an object), got "
                                                          f"{type(schema).__name__}")
            self._key = ("json", json.dumps(schema))  # key order kept: it is the order of the output
        elif kind == "json_object":
            self._key = ("json_object",)
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise SamplingParamsError(f"{name}.choice", "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
            self._key = ("choice", tuple(self.choice))
        elif kind == "grammar" and type(self.grammar).__module__.startswith("xgrammar"):
            self._key = ("grammar", self.grammar)  # an xgrammar.Grammar built with its API (tool calls)
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise SamplingParamsError(f"{name}.{kind}", f"must be a non-empty string, got {value!r}")
            self._key = (kind, value)

    @property
    def kind(self) -> str:
        return self._key[0]


@dataclass
class SamplingParams:
    max_tokens: int = 256
    n: int = 1                    # parallel samples of the prompt (they share its KV blocks)
    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    min_p: float = 0.0            # 0 = off
    seed: int | None = None       # None: a random seed drawn when the request is made
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)          # stop strings, not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's end tokens
    ignore_eos: bool = False
    logprobs: int | None = None   # how many top log-probabilities to return per token (<= 20)
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"  # see OUTPUT_KINDS
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self):
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        self.n = check_int("n", self.n, 1, MAX_SAMPLES)
        self.temperature = check_float("temperature", self.temperature, 0.0, FLOAT32_MAX)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingParamsError("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                                                     f"got {self.temperature!r}")
        self.top_k = check_int("top_k", self.top_k, 0, INT32_MAX)
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.min_p = check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0, (1 << 63) - 1)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty,
                                              *REPETITION_PENALTY_RANGE)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise SamplingParamsError("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = [check_text("stop", s) for s in self.stop]
        if not all(self.stop):
            raise SamplingParamsError("stop", "must not contain an empty string")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", "must be a list of token ids")
        self.stop_token_ids = [check_int("stop_token_ids", t, 0, INT32_MAX) for t in self.stop_token_ids]
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.skip_special_tokens = check_bool("skip_special_tokens", self.skip_special_tokens)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", f"must be StructuredOutputsParams, got "
                                                            f"{type(self.structured_outputs).__name__}")
        if self.output_kind not in OUTPUT_KINDS:
            raise SamplingParamsError("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def needs_logits(self) -> bool:
        """The sampler must see the logits themselves: for log-probabilities, penalties or a grammar mask."""
        return self.logprobs is not None or self.has_penalties or self.structured_outputs is not None
