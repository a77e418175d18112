"""The shared LMI request parser: strict types and ranges, clear reasons."""

import re

import pytest

from lmc.runtime.engines.base import GenerationParams
from lmc.runtime.requests import parse_invocation, parse_parameters


def test_full_parameters_parse():
    params = parse_parameters({"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "do_sample": True,
                               "seed": 3, "stop": ["\n", "END"], "repetition_penalty": 1.2,
                               "return_full_text": True}, 64)
    assert params == GenerationParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=40, do_sample=True, seed=3,
                                      stop=("\n", "END"), repetition_penalty=1.2, return_full_text=True)


def test_defaults_and_single_stop_string():
    assert parse_parameters({}) == GenerationParams()
    assert parse_parameters({"stop": "x"}).stop == ("x",)
    assert parse_parameters({"max_new_tokens": 4.0}).max_new_tokens == 4


def test_temperature_zero_means_greedy():
    params = parse_parameters({"temperature": 0, "do_sample": True})
    assert params.do_sample is False and params.temperature == 1.0


@pytest.mark.parametrize("params, message", [
    ({"max_new_tokens": 0}, "parameters.max_new_tokens must be >= 1, got 0"),
    ({"max_new_tokens": "5"}, "parameters.max_new_tokens must be an integer, got a string"),
    ({"max_new_tokens": True}, "parameters.max_new_tokens must be an integer, got a boolean"),
    ({"max_new_tokens": 2.5}, "must be an integer"),
    ({"max_new_tokens": 64}, "leaves no room for a prompt within the maximum sequence length 64"),
    ({"temperature": -1}, "parameters.temperature must be in [0, 100], got -1"),
    ({"top_p": 1.5}, "parameters.top_p must be in [0, 1], got 1.5"),
    ({"top_k": -2}, "parameters.top_k must be >= -1"),
    ({"do_sample": "yes"}, "parameters.do_sample must be true or false, got a string"),
    ({"seed": 2**63}, "parameters.seed must be in [-9223372036854775808, 9223372036854775807]"),
    ({"stop": [""]}, "parameters.stop[0] must be a non-empty string"),
    ({"stop": 5}, "parameters.stop must be a string or a list of strings"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"max_tokens": 5}, "unknown parameter 'max_tokens'; accepted: max_new_tokens"),
    ({"temperature": float("nan")}, "parameters.temperature must be in"),
    # JSON integers have no bound: past a float's range they are out of range, not an OverflowError (a 500).
    ({"temperature": 10**400}, "parameters.temperature must be in [0, 100], got an integer of 401 digits"),
    ({"top_p": -10**400}, "parameters.top_p must be in [0, 1], got an integer of 401 digits"),
    ({"frequency_penalty": 10**309}, "parameters.frequency_penalty must be in [-2, 2]"),
    ({"max_new_tokens": 10**30}, "parameters.max_new_tokens = an integer of 31 digits leaves no room"),
    ({"do_sample": "x" * 100}, "parameters.do_sample must be true or false, got a string ('xxxxxxxxxx"),
])
def test_bad_parameters_are_rejected_with_the_reason(params, message):
    with pytest.raises(ValueError) as excinfo:
        parse_parameters(params, 64)
    assert message in str(excinfo.value)


def test_invocation_shapes():
    assert parse_invocation({"inputs": "hi"}) == (["hi"], GenerationParams(), False, False)
    prompts, params, stream, details = parse_invocation({"inputs": ["a", "b"], "stream": True,
                                                         "parameters": {"max_new_tokens": 3, "details": True}})
    assert prompts == ["a", "b"] and params.max_new_tokens == 3 and stream is True and details is True


def test_openai_penalties_and_logit_bias_are_parsed_and_bounded():
    params = parse_parameters({"frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"50": -100, "7": 2.5}})
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -1.0)
    assert params.logit_bias == ((7, 2.5), (50, -100.0))
    for bad, message in [({"frequency_penalty": 2.5}, "parameters.frequency_penalty must be in [-2, 2]"),
                         ({"logit_bias": {"x": 1}}, "parameters.logit_bias keys must be token ids, got 'x'"),
                         ({"logit_bias": {"1": 101}}, "parameters.logit_bias['1'] must be a number in [-100, 100]"),
                         ({"logit_bias": {"1": True}}, "parameters.logit_bias['1'] must be a number"),
                         ({"logit_bias": [1]}, "parameters.logit_bias must be an object"),
                         # isdigit() is true for these, int() refuses them: the 400 must still name the field.
                         ({"logit_bias": {"\u00b2": 1}}, "parameters.logit_bias keys must be token ids, got '\u00b2'"),
                         ({"logit_bias": {"\u0663": 1}}, "parameters.logit_bias keys must be token ids"),
                         ({"logit_bias": {"9" * 5000: 1}}, "parameters.logit_bias keys must be token ids, got '999"),
                         ({"logit_bias": {"1": 100, "01": 100}}, "names token id 1 more than once"),
                         ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_parameters(bad)


def test_min_new_tokens_and_ignore_eos_token_are_parsed():
    params = parse_parameters({"max_new_tokens": 8, "min_new_tokens": 8, "ignore_eos_token": True})
    assert (params.min_new_tokens, params.ignore_eos) == (8, True)
    with pytest.raises(ValueError, match="parameters.min_new_tokens = 9 is more than max_new_tokens = 8"):
        parse_parameters({"max_new_tokens": 8, "min_new_tokens": 9})
    with pytest.raises(ValueError, match="parameters.ignore_eos_token must be true or false"):
        parse_parameters({"ignore_eos_token": 1})


def test_openai_extensions_map_to_the_lmi_parameters_and_errors_name_the_openai_field():
    from lmc.runtime.openai_api import _params

    params = _params({"prompt": "a", "max_tokens": 5, "min_tokens": 3, "ignore_eos": True}, 16, 64)
    assert (params.min_new_tokens, params.ignore_eos, params.max_new_tokens) == (3, True, 5)
    with pytest.raises(ValueError, match="^min_tokens = 6 is more than max_tokens = 5$"):
        _params({"prompt": "a", "max_tokens": 5, "min_tokens": 6}, 16, 64)


def test_lmi_and_vllm_spellings_are_accepted():
    """LMI documents `stop_sequences` and `details`; vLLM clients send top_k -1 for "off"."""
    assert parse_parameters({"stop_sequences": ["\n\n", "###"]}).stop == ("\n\n", "###")
    assert parse_parameters({"top_k": -1}).top_k == 0 == GenerationParams().top_k
    assert parse_parameters({"details": False}) == GenerationParams()
    with pytest.raises(ValueError, match="parameters.stop or parameters.stop_sequences"):
        parse_parameters({"stop": "a", "stop_sequences": ["b"]})
    with pytest.raises(ValueError, match=r"parameters.stop_sequences\[0\] must be a non-empty string"):
        parse_parameters({"stop_sequences": [""]})
    with pytest.raises(ValueError, match="parameters.details must be true or false"):
        parse_parameters({"details": "yes"})


@pytest.mark.parametrize("body, message", [
    ([1], "request body must be a JSON object with 'inputs', got an array"),
    ({"parameters": {}}, "request body has no 'inputs'"),
    ({"inputs": []}, "inputs is an empty list"),
    ({"inputs": ["a", 3]}, "inputs[1] must be a string, got a number"),
    ({"inputs": 3}, "inputs must be a string or a list of strings, got a number"),
    ({"inputs": "a", "stream": "yes"}, "stream must be true or false"),
    ({"inputs": "a", "prompt": "b"}, "unknown request key 'prompt'"),
    ({"inputs": "a", "parameters": []}, "parameters must be a JSON object, got an array"),
])
def test_bad_invocations_are_rejected_with_the_reason(body, message):
    with pytest.raises(ValueError) as excinfo:
        parse_invocation(body)
    assert message in str(excinfo.value)


def test_openai_legal_values_are_accepted_and_top_p_zero_keeps_the_top_token():
    """OpenAI takes any int64 seed and top_p = 0; the nucleus is then the single most likely token."""
    import torch

    from lmc.runtime.engines.generate import choose_token

    params = parse_parameters({"seed": -1, "top_p": 0, "do_sample": True, "temperature": 1.5})
    assert params.seed == -1 and params.top_p == 0.0
    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    picks = {choose_token(logits, params, [], torch.Generator().manual_seed(s)) for s in range(50)}
    assert picks == {1}


def test_log_probabilities_that_are_not_finite_are_reported_as_vllm_does():
    """JSON has no infinity: a masked (-inf) or NaN logit's log-probability is -9999.0 in the logprobs
    entries (vLLM's stand-in); a streamed piece's log_prob is null instead. Finite ones are exact."""
    import math

    import torch

    from lmc.runtime.engines.generate import _log_prob, _logprob_entry

    logits = torch.tensor([0.0, math.log(3.0), -math.inf, math.nan])
    chosen, top = _logprob_entry(logits, 2, 4)
    assert chosen == -9999.0
    # NaN poisons logsumexp, so every entry is NaN → -9999.0: nothing non-finite reaches the JSON.
    assert all(value == -9999.0 for _, value in top) and len(top) == 4
    finite = torch.tensor([0.0, math.log(3.0), -math.inf])
    chosen, top = _logprob_entry(finite, 1, 2)
    assert chosen == pytest.approx(math.log(0.75)) and [index for index, _ in top] == [1, 0]
    assert _logprob_entry(finite, 2, 0) == (-9999.0, ())
    assert _log_prob(finite, 2) is None and _log_prob(finite, 0) == pytest.approx(math.log(0.25))
