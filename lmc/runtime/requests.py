"""Parsing of the LMI request schema, shared by the HTTP server and the DJL handler.

Pure: JSON-decoded values in, `GenerationParams` out. Every rejection is a ValueError whose message
names the offending key and says what is accepted; the server answers it with 400.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from lmc.errors import short_repr
from lmc.runtime.engines.base import GenerationParams, GenerationResult, Piece

MAX_STOP_SEQUENCES = 16
_PARAMETER_KEYS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "do_sample", "seed", "stop", "stop_sequences",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "return_full_text", "details",
    "min_new_tokens", "ignore_eos_token",
)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's own limit)
_BODY_KEYS = ("inputs", "parameters", "stream")


def parse_parameters(params: dict, max_sequence_length: int | None = None) -> GenerationParams:
    """Validate the LMI `parameters` object strictly and return the engine's parameters.

    `temperature` 0 means greedy (OpenAI clients send it), whatever `do_sample` says.
    With `max_sequence_length`, `max_new_tokens` must leave room for at least one prompt token;
    the engine checks prompt + max_new_tokens once the prompt is tokenized.
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"parameters must be a JSON object, got {_json_type(params)}")
    unknown = sorted(set(params) - set(_PARAMETER_KEYS))
    if unknown:
        raise ValueError(f"unknown parameter {short_repr(unknown[0])}; accepted: {', '.join(_PARAMETER_KEYS)}")
    defaults = GenerationParams()
    values: dict[str, Any] = {}
    if "max_new_tokens" in params:
        values["max_new_tokens"] = _int(params, "max_new_tokens", minimum=1)
        if max_sequence_length is not None and values["max_new_tokens"] >= max_sequence_length:
            raise ValueError(f"parameters.max_new_tokens = {short_repr(values['max_new_tokens'])} leaves no room for a prompt "
                             f"within the maximum sequence length {max_sequence_length}")
    if "temperature" in params:
        values["temperature"] = _number(params, "temperature", minimum=0.0, maximum=100.0)
    if "top_p" in params:
        # 0 is allowed (OpenAI allows it): the nucleus is then the most likely token alone.
        values["top_p"] = _number(params, "top_p", minimum=0.0, maximum=1.0)
    if "top_k" in params:
        # -1 is vLLM's spelling of "off" (LMI documents it as vLLM's default); 0 is HF's.
        values["top_k"] = max(0, _int(params, "top_k", minimum=-1))
    if "do_sample" in params:
        values["do_sample"] = _bool(params, "do_sample")
    if "seed" in params and params["seed"] is not None:
        values["seed"] = _int(params, "seed", minimum=-2**63, maximum=2**63 - 1)  # any int64, as OpenAI takes
    if params.get("stop") is not None and params.get("stop_sequences") is not None:
        raise ValueError("give parameters.stop or parameters.stop_sequences (LMI's name for it), not both")
    for key in ("stop", "stop_sequences"):
        if params.get(key) is not None:
            values["stop"] = _stop(params[key], key)
    if "details" in params:
        _bool(params, "details")  # the caller reads it: not a generation parameter
    if "repetition_penalty" in params:
        penalty = _number(params, "repetition_penalty", minimum=0.0, maximum=100.0)
        if penalty == 0.0:
            raise ValueError("parameters.repetition_penalty must be > 0, got 0")
        values["repetition_penalty"] = penalty
    for key in ("frequency_penalty", "presence_penalty"):  # OpenAI's range, as vLLM takes them
        if params.get(key) is not None:
            values[key] = _number(params, key, minimum=-2.0, maximum=2.0)
    if params.get("logit_bias") is not None:
        values["logit_bias"] = _logit_bias(params["logit_bias"])
    if params.get("min_new_tokens") is not None:
        values["min_new_tokens"] = _int(params, "min_new_tokens", minimum=0)
        if values["min_new_tokens"] > values.get("max_new_tokens", defaults.max_new_tokens):
            raise ValueError(f"parameters.min_new_tokens = {short_repr(values['min_new_tokens'])} is more than max_new_tokens = "
                             f"{values.get('max_new_tokens', defaults.max_new_tokens)}")
    if "ignore_eos_token" in params:
        values["ignore_eos"] = _bool(params, "ignore_eos_token")
    if "return_full_text" in params:
        values["return_full_text"] = _bool(params, "return_full_text")
    if values.get("temperature", defaults.temperature) == 0.0:
        values["do_sample"] = False
        values["temperature"] = 1.0
    return GenerationParams(**values)


def parse_invocation(body: object, max_sequence_length: int | None = None
                     ) -> tuple[list[str], GenerationParams, bool, bool]:
    """Validate an LMI /invocations body: `{"inputs": str | [str], "parameters": {...}, "stream": bool}`.

    Returns (prompts, parameters, stream, details): `parameters.details` asks for LMI's `details`
    object beside each answer. A single string gives a one-element list.
    """
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object with 'inputs', got {_json_type(body)}")
    unknown = sorted(set(body) - set(_BODY_KEYS))
    if unknown:
        raise ValueError(f"unknown request key {short_repr(unknown[0])}; accepted: {', '.join(_BODY_KEYS)}")
    if "inputs" not in body:
        raise ValueError("request body has no 'inputs' (a string or a list of strings)")
    inputs = body["inputs"]
    if isinstance(inputs, str):
        prompts = [inputs]
    elif isinstance(inputs, list):
        if not inputs:
            raise ValueError("inputs is an empty list; give at least one prompt")
        for index, item in enumerate(inputs):
            if not isinstance(item, str):
                raise ValueError(f"inputs[{index}] must be a string, got {_json_type(item)}")
        prompts = list(inputs)
    else:
        raise ValueError(f"inputs must be a string or a list of strings, got {_json_type(inputs)}")
    params = parse_parameters(body.get("parameters"), max_sequence_length)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream must be true or false, got {_json_type(stream)}")
    return prompts, params, stream, bool((body.get("parameters") or {}).get("details", False))


# LMI's (and TGI's) names for why generation ended.
_LMI_FINISH = {"length": "length", "eos": "eos_token", "stop": "stop_sequence"}


def lmi_details(prompt: str, result: GenerationResult, token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """LMI's `details` object for one answer; `tokens` ({id, text, log_prob} per generated token) when the
    engine reported log-probabilities and `token_text` can name the tokens."""
    details: dict[str, Any] = {"finish_reason": _LMI_FINISH.get(result.finish_reason, result.finish_reason),
                               "generated_tokens": result.generated_tokens, "inputs": prompt}
    if result.logprobs is not None and token_text is not None:
        details["tokens"] = [{"id": token, "text": token_text(token), "log_prob": value}
                             for token, (value, _) in zip(result.token_ids, result.logprobs)]
    return details


def queue_overflow(label: str, count: int, capacity: int) -> str | None:
    """Why a request of `count` prompts (answers) can never be admitted by a queue of `capacity`, or None: the
    same 400 from lmc's own engines (core.make_jobs) and from its front in front of vLLM (vllm_front)."""
    if count <= capacity:
        return None
    return f"{label} has {count} prompts; the request queue holds {capacity}: send at most {capacity} per request"


def check_logit_bias(params: GenerationParams, vocab_size: int | None) -> None:
    """ValueError when logit_bias names a token past the tokenizer's vocabulary (its ids are sorted)."""
    if params.logit_bias and vocab_size is not None and params.logit_bias[-1][0] >= vocab_size:
        raise ValueError(f"logit_bias names token id {params.logit_bias[-1][0]}; "
                         f"the vocabulary has ids 0-{vocab_size - 1}")


def jsonline(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


class LmiLines:
    """LMI's jsonlines for one streamed answer, fed its pieces then its result: one
    {"token": {"id", "text", "log_prob"}} line per piece (the token that completed its text). The piece
    marked last waits for the result: the last line is that finishing token, so a client reading
    line["token"] meets no line without it, with `generated_text`, and `details` (without tokens: the
    lines gave them) when the request asked for them, as LMI does."""

    def __init__(self, prompt: str, details: bool):
        self.prompt, self.details = prompt, details
        self._last: Piece | None = None

    def piece(self, piece: Piece | str) -> bytes | None:
        piece = piece if isinstance(piece, Piece) else Piece(piece)
        if piece.last:
            self._last = piece
            return None
        return jsonline(_token_line(piece))

    def result(self, result: GenerationResult) -> bytes:
        last = self._last or Piece("", result.token_ids[-1] if result.token_ids else None)  # (an engine marks none)
        line = {**_token_line(last), "generated_text": result.text}
        if self.details:
            line["details"] = lmi_details(self.prompt, result)
        return jsonline(line)


def _token_line(piece: Piece) -> dict[str, Any]:
    return {"token": {"id": piece.token_id, "text": piece.text, "log_prob": piece.log_prob}}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _int(params: dict, key: str, *, minimum: int, maximum: int | None = None) -> int:
    value = params[key]
    # JSON has one number type: accept 5.0 but not 5.5, and never booleans.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"parameters.{key} must be an integer, got {_json_type(value)} ({short_repr(value)})")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"parameters.{key} must be {bound}, got {short_repr(value)}")
    return value


def _number(params: dict, key: str, *, minimum: float, maximum: float) -> float:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"parameters.{key} must be a number, got {_json_type(value)} ({short_repr(value)})")
    # Compared before converting: an integer beyond a float's range (JSON allows any) is just out of range.
    if not (isinstance(value, int) or math.isfinite(value)) or not minimum <= value <= maximum:
        raise ValueError(f"parameters.{key} must be in [{minimum:g}, {maximum:g}], got {short_repr(value)}")
    return float(value)


def _bool(params: dict, key: str) -> bool:
    value = params[key]
    if not isinstance(value, bool):
        raise ValueError(f"parameters.{key} must be true or false, got {_json_type(value)} ({short_repr(value)})")
    return value


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {token id (a JSON object key, so a string): bias in [-100, 100]}."""
    if not isinstance(value, dict):
        raise ValueError(f"parameters.logit_bias must be an object of token id -> bias, got {_json_type(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"parameters.logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    pairs = []
    for key, bias in value.items():
        # isdecimal, not isdigit: int() refuses superscripts; a token id has at most 10 digits.
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and len(key.lstrip("0")) <= 10):
            raise ValueError(f"parameters.logit_bias keys must be token ids, got {short_repr(key)}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"parameters.logit_bias[{key!r}] must be a number in [-100, 100], got {short_repr(bias)}")
        pairs.append((int(key), float(bias)))
    ids = [token for token, _ in pairs]
    if len(set(ids)) != len(ids):  # "1" and "01" name the same token: the biases would add up past 100
        twice = next(token for token in ids if ids.count(token) > 1)
        raise ValueError(f"parameters.logit_bias names token id {twice} more than once")
    return tuple(sorted(pairs))


def _stop(value: object, key: str = "stop") -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError(f"parameters.{key} must be a string or a list of strings, got {_json_type(value)}")
    if len(items) > MAX_STOP_SEQUENCES:
        raise ValueError(f"parameters.{key} has {len(items)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
    for index, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise ValueError(f"parameters.{key}[{index}] must be a non-empty string, got {short_repr(item)}")
    return tuple(items)
