"""The load generator behind `lmc bench`: closed-loop clients streaming OpenAI `/v1/completions`.

Why not guidellm: `pip install --dry-run guidellm` (0.8.1) would downgrade click (8.5.1 → 8.4.2)
and multidict (7.2.1 → 6.9.1, which aiohttp and vLLM use) and pull pandas, pyarrow, datasets and a
second web server (sanic) into the serving environment. This is an asyncio client over httpx
(already a dependency of the tests and of the openai client), doing what those tools do for a
fixed-length workload:

- prompts of an exact token count: a repeated word, sized with the server's own count (the
  `usage.prompt_tokens` of two probes gives tokens = a·words + b; a third checks the result), so
  it needs no tokenizer on the client and works against lmc, vLLM or TGI alike;
- outputs of an exact length: `max_tokens = min_tokens = N` with `ignore_eos` (vLLM's extensions,
  which lmc honours), checked against `usage.completion_tokens`;
- one streamed chunk per token: a random-weight model emits byte tokens that complete no character,
  and servers hold such text back, so chunks stop marking tokens. Given the model's tokenizer (an
  artifact has it), the prompt word's token gets `logit_bias` +100: every token is that word, and
  streams as it is made. The report says how many chunks came per token;
- TTFT = request sent → first streamed text; TPOT = (end − first text) / (completion tokens − 1);
  end-to-end = request sent → `[DONE]`;
- a level of concurrency c: c clients, each sending its next request when its last one ends, after
  one warm-up round of c requests that is not counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from lmc.errors import LmcError

_WORDS = (" the", " hello", " a", " x", " token")


class BenchError(LmcError):
    """The server did not answer as a benchmark needs (no usage counts, an error status)."""


@dataclass(frozen=True)
class Sample:
    """One request's timings (seconds since its start) and token counts."""

    start: float  # perf_counter at send
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    chunks: int = 0  # streamed chunks that carried text

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def _completion_body(prompt: str, output_tokens: int, model: str, stream: bool, bias_token: int | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    if bias_token is not None:
        body["logit_bias"] = {str(bias_token): 100}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _prompt_tokens(client, url: str, model: str, prompt: str) -> int:
    response = await client.post(f"{url}/v1/completions", json=_completion_body(prompt, 1, model, stream=False))
    if response.status_code != 200:
        raise BenchError(f"{url}/v1/completions answered {response.status_code}: {response.text[:200]}")
    usage = response.json().get("usage") or {}
    if not isinstance(usage.get("prompt_tokens"), int):
        raise BenchError(f"{url}/v1/completions gives no usage.prompt_tokens; the bench needs it to size prompts")
    return usage["prompt_tokens"]


async def build_prompt(client, url: str, model: str, tokens: int) -> tuple[str, str]:
    """(a prompt the server counts as exactly `tokens` tokens, its special tokens included; the word
    repeated in it, one token each)."""
    # Probes of k and 2k words stay within the target, so within the server's sequence length.
    k = max(1, tokens // 3)
    for word in _WORDS:
        low, high = await _prompt_tokens(client, url, model, word * k), await _prompt_tokens(client, url, model, word * 2 * k)
        if high - low != k:
            continue  # the word merges with its neighbours: try another
        words = tokens - (low - k)
        if words < 1:
            raise BenchError(f"--input-tokens {tokens}: the server adds {low - k} tokens to every prompt; ask for more")
        prompt = word * words
        if await _prompt_tokens(client, url, model, prompt) == tokens:
            return prompt, word
    raise BenchError(f"could not build a prompt of exactly {tokens} tokens from repeated words")


async def _one(client, url: str, body: dict) -> Sample:
    start = time.perf_counter()
    first = None
    usage: dict = {}
    error = None
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Sample(start, 0.0, time.perf_counter() - start, 0, 0, f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    except Exception as exc:  # the network, a malformed chunk: recorded on the sample, counted as an error
        error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.perf_counter()
    if error is None and not usage:
        error = "the stream carried no usage (stream_options.include_usage)"
    return Sample(start, (first or end) - start, end - start, int(usage.get("prompt_tokens", 0)),
                  int(usage.get("completion_tokens", 0)), error, chunks)


def word_token(tokenizer_file, word: str) -> int | None:
    """The id of `word` in a tokenizer.json, when it is one token; else None."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(word, add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 else None


async def run_level(client, url: str, body: dict, concurrency: int, requests: int) -> tuple[list[Sample], float]:
    """`requests` requests from `concurrency` closed-loop clients, after a warm-up round; (samples, wall s)."""
    await asyncio.gather(*[_one(client, url, body) for _ in range(concurrency)])  # warm-up, not counted
    queue = list(range(requests))
    samples: list[Sample] = []

    async def client_loop() -> None:
        while queue:
            queue.pop()
            samples.append(await _one(client, url, body))

    begin = time.perf_counter()
    await asyncio.gather(*[client_loop() for _ in range(concurrency)])
    return samples, time.perf_counter() - begin


async def served_model(client, url: str) -> str:
    """The model name to send: the first of /v1/models (lmc and vLLM answer any other 404), else "model"
    (a server without the route: LMI's, which does not read it)."""
    try:
        response = await client.get(f"{url}/v1/models")
        data = response.json().get("data") or []
        if response.status_code == 200 and data and isinstance(data[0].get("id"), str):
            return data[0]["id"]
    except Exception:  # no /v1/models (LMI): any name
        pass
    return "model"


def make_client(timeout_s: float, connections: int):
    import httpx

    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits)
