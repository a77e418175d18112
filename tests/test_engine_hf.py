"""The hf engine at TP=1: greedy equals HF generate, batching, sampling, stops, streaming, limits, dtypes."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

try:
    from _engine_helpers import build_artifact, hf_greedy, make_checkpoint
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import build_artifact, hf_greedy, make_checkpoint

from lmc.errors import ArtifactError
from lmc.runtime.engines import create_engine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
from lmc.runtime.engines.generate import _Row, _safe_prefix, choose_token

PROMPTS = ["the quick brown", "héllo wörld, large models are served"]
TASKS = {"t5": "text2text-generation"}


def _engine(family, artifact, *, dtype="fp32", tp=1, max_len=128):
    engine = create_engine("hf", family=family, task=TASKS.get(family, "text-generation"), dtype=dtype,
                           tensor_parallel_degree=tp, max_sequence_length=max_len, batch_size=4, device="cpu")
    engine.load(artifact, 0, 1)
    return engine


def _req(i, prompt, **params):
    return GenerationRequest(str(i), prompt, GenerationParams(**params))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    checkpoint = make_checkpoint("llama", root / "ckpt")
    return checkpoint, _engine("llama", build_artifact(checkpoint, root / "art", 1))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt_neox", "opt", "gptj", "bloom", "t5"])
def test_greedy_equals_hf_generate(family, tmp_path):
    checkpoint = make_checkpoint(family, tmp_path / "ckpt")
    engine = _engine(family, build_artifact(checkpoint, tmp_path / "art", 1))
    results = engine.generate([_req(i, p, max_new_tokens=10) for i, p in enumerate(PROMPTS)])
    for prompt, result in zip(PROMPTS, results, strict=True):
        reference = hf_greedy(checkpoint, prompt, 10)
        assert result.token_ids == reference
        assert result.finish_reason == ("length" if len(reference) == 10 else "eos")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma3_text", "granite", "phi3", "gpt_oss", "deepseek_v3"])
def test_any_architecture_at_tp_1_equals_hf_generate(family, tmp_path):
    # Architectures lmc has no tensor-parallel layout for are served whole at TP 1 (any class
    # AutoModelForCausalLM builds): a batch of two prompts answers as HF generate on each alone.
    checkpoint = make_checkpoint(family, tmp_path / "ckpt")
    engine = _engine(family, build_artifact(checkpoint, tmp_path / "art", 1))
    results = engine.generate([_req(i, p, max_new_tokens=10) for i, p in enumerate(PROMPTS)])
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(checkpoint, prompt, 10), (family, prompt)


def test_a_whole_model_shard_missing_a_tensor_is_an_artifact_error(tmp_path):
    from safetensors.torch import load_file, save_file

    checkpoint = make_checkpoint("qwen3", tmp_path / "ckpt")
    artifact = build_artifact(checkpoint, tmp_path / "art", 1)
    shard = artifact / "shards" / "tp1" / "rank0.safetensors"
    state = load_file(shard)
    del state["model.layers.1.self_attn.q_norm.weight"]
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match=r"rank0.safetensors: does not match the model config.json builds: "
                                            r"missing keys model.layers.1.self_attn.q_norm.weight"):
        _engine("qwen3", artifact)


def test_artifact_from_the_build_partitioner_matches_hf(tmp_path):
    checkpoint = make_checkpoint("gpt_neox", tmp_path / "ckpt")
    engine = _engine("gpt_neox", build_artifact(checkpoint, tmp_path / "art", 1, "fp32"))
    assert engine.generate([_req(0, PROMPTS[0], max_new_tokens=8)])[0].token_ids == hf_greedy(checkpoint, PROMPTS[0], 8)


def test_batched_greedy_equals_single_requests(llama):
    _, engine = llama
    prompts = ["a", "the quick brown fox jumps over", "héllo"]
    batched = engine.generate([_req(i, p, max_new_tokens=8) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert batched[i].token_ids == engine.generate([_req(i, prompt, max_new_tokens=8)])[0].token_ids
        assert batched[i].id == str(i)


def test_per_request_parameters_in_one_batch(llama):
    _, engine = llama
    results = engine.generate([_req(0, "the quick", max_new_tokens=3), _req(1, "the quick", max_new_tokens=7),
                               _req(2, "the quick", max_new_tokens=5, do_sample=True, seed=1)])
    assert [r.generated_tokens for r in results] == [3, 7, 5]
    assert results[1].token_ids[:3] == results[0].token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(llama):
    _, engine = llama
    params = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=50, top_p=0.95, seed=1234)
    alone = engine.generate([_req(0, "the quick", **params)])[0].token_ids
    again = engine.generate([_req(9, "large models", max_new_tokens=4), _req(0, "the quick", **params)])[1].token_ids
    other_seed = engine.generate([_req(0, "the quick", **dict(params, seed=99))])[0].token_ids
    assert alone == again
    assert alone != other_seed


def test_choose_token_filters():
    logits = torch.tensor([1.0, 5.0, 3.0, -2.0])
    assert choose_token(logits, GenerationParams(), [], None) == 1
    # top_k=1 always samples the argmax; a repetition penalty on it moves greedy to the runner-up.
    generator = torch.Generator().manual_seed(0)
    assert {choose_token(logits, GenerationParams(do_sample=True, top_k=1), [], generator) for _ in range(20)} == {1}
    assert choose_token(logits, GenerationParams(repetition_penalty=2.0), [1], None) == 2
    # top_p small enough keeps only the most likely token.
    assert {choose_token(logits, GenerationParams(do_sample=True, top_p=0.5), [], generator) for _ in range(20)} == {1}
    # a negative score is multiplied by the penalty (more negative), as HF does.
    assert choose_token(torch.tensor([-1.0, -1.5]), GenerationParams(repetition_penalty=2.0), [0], None) == 1


def test_openai_penalties_and_logit_bias_follow_openai_formulas():
    """score -= frequency_penalty * count + presence_penalty * (count > 0), over generated tokens only;
    logit_bias is added to the raw logits, greedy or sampled; ids past a padded vocabulary are skipped."""
    logits = torch.tensor([4.0, 3.5, 3.0, 0.0])

    def counts(*generated):
        return torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=4)

    # token 0 generated twice: 4 - 0.3*2 - 0.2 = 3.2 < 3.5, so greedy moves to token 1
    both = GenerationParams(frequency_penalty=0.3, presence_penalty=0.2)
    assert choose_token(logits, both, [0, 0], None, counts(0, 0)) == 1
    assert choose_token(logits, GenerationParams(frequency_penalty=0.2), [0, 0], None, counts(0, 0)) == 0  # 3.6 > 3.5
    # a negative penalty rewards repeats
    assert choose_token(logits, GenerationParams(presence_penalty=-2.0), [3], None, counts(3)) == 0
    assert choose_token(torch.tensor([4.0, 3.5, 3.0, 2.5]), GenerationParams(presence_penalty=-2.0), [3], None,
                        counts(3)) == 3
    assert choose_token(logits, GenerationParams(logit_bias=((2, 1.5),)), [], None) == 2
    banned = GenerationParams(do_sample=True, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))
    generator = torch.Generator().manual_seed(0)
    assert {choose_token(logits, banned, [], generator) for _ in range(20)} == {3}
    assert choose_token(logits, GenerationParams(logit_bias=((9, 100.0),)), [], None) == 0


def test_stop_sequence_trims_text_and_streaming_never_shows_it(llama):
    _, engine = llama
    full = engine.generate([_req(0, "the quick", max_new_tokens=12)])[0]
    assert len(full.text) > 4
    stop = full.text[3:5]
    pieces = []
    result = engine.generate([_req(0, "the quick", max_new_tokens=12, stop=(stop,))],
                             on_token=lambda rid, piece: pieces.append(piece.text))[0]
    assert result.finish_reason == "stop"
    assert result.text == full.text[:full.text.find(stop)]
    assert "".join(pieces) == result.text


def test_streaming_pieces_concatenate_to_the_text(llama):
    _, engine = llama
    pieces: dict[str, list[str]] = {"0": [], "1": []}
    results = engine.generate([_req(0, PROMPTS[0], max_new_tokens=9), _req(1, PROMPTS[1], max_new_tokens=5)],
                              on_token=lambda rid, piece: pieces[rid].append(piece.text))
    for result in results:
        assert "".join(pieces[result.id]) == result.text


def test_streamed_pieces_carry_their_token_and_its_log_probability_under_the_model(llama):
    """Each piece names the token that completed it and that token's log-probability (HF's own logits,
    before penalties); only the last piece is marked last, in a batch where one request ends early."""
    import transformers as tf

    checkpoint, engine = llama
    pieces: dict[str, list] = {"0": [], "1": []}
    results = engine.generate([_req(0, PROMPTS[0], max_new_tokens=6, repetition_penalty=1.3),
                               _req(1, PROMPTS[1], max_new_tokens=2)],
                              on_token=lambda rid, piece: pieces[rid].append(piece))
    model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    for prompt, result in zip(PROMPTS, results, strict=True):
        streamed = pieces[result.id]
        assert [piece.last for piece in streamed] == [False] * (len(streamed) - 1) + [True]
        assert streamed[-1].token_id == result.token_ids[-1]  # both finish by length
        prompt_ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + result.token_ids])).logits[0].float()
        expected = {i: float(torch.log_softmax(logits[len(prompt_ids) - 1 + i], -1)[token])
                    for i, token in enumerate(result.token_ids)}
        position = -1
        for piece in streamed:  # pieces follow the tokens in order; a token that adds no text sends none
            position = result.token_ids.index(piece.token_id, position + 1)
            assert piece.log_prob == pytest.approx(expected[position], abs=1e-4)


def test_penalties_count_generated_tokens_only_and_follow_the_formula_in_the_loop(llama):
    """The decode loop keeps each row's counts step by step. A +6 logit_bias makes one token win until the
    frequency penalty (2 per occurrence) outweighs it: the answer equals a reference loop applying
    OpenAI's formulas to HF's logits over the tokens generated so far (the prompt does not count), so
    a count that is stale or counted twice changes how often that token appears."""
    import transformers as tf

    checkpoint, engine = llama
    favoured = 20
    params = dict(max_new_tokens=10, frequency_penalty=2.0, presence_penalty=0.5, logit_bias=((favoured, 6.0),))
    penalised = engine.generate([_req(0, PROMPTS[0], **params)])[0].token_ids
    model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tf.AutoTokenizer.from_pretrained(checkpoint)(PROMPTS[0]).input_ids
    generated: list[int] = []
    with torch.no_grad():
        while len(generated) < 10:
            scores = model(torch.tensor([ids + generated])).logits[0, -1].float()
            scores[favoured] += 6.0
            for token in set(generated):
                scores[token] -= 2.0 * generated.count(token) + 0.5
            generated.append(int(scores.argmax()))
    assert penalised == generated[:len(penalised)], (penalised, generated)
    assert 1 < penalised.count(favoured) < 10  # the bias won at first, the penalty later


def test_min_new_tokens_holds_eos_back_and_ignore_eos_keeps_going(llama):
    """A +100 bias makes EOS the choice at every step: it ends the answer at once; with min_new_tokens 3
    after 3 tokens; with ignore_eos never (a fixed-length answer, as benchmark clients ask for)."""
    _, engine = llama
    eos = min(engine.loop.eos_token_ids)
    force = dict(max_new_tokens=5, logit_bias=((eos, 100.0),))
    plain, held, ignored = engine.generate([_req(0, PROMPTS[0], **force), _req(1, PROMPTS[0], min_new_tokens=3, **force),
                                            _req(2, PROMPTS[0], ignore_eos=True, **force)])
    assert (plain.token_ids, plain.finish_reason) == ([], "eos")
    assert len(held.token_ids) == 3 and eos not in held.token_ids and held.finish_reason == "eos"
    assert (ignored.token_ids, ignored.finish_reason, ignored.text) == ([eos] * 5, "length", "")
    # with ignore_eos, min_new_tokens does not hold EOS back either (it ends nothing): vLLM's rule
    both = engine.generate([_req(3, PROMPTS[0], min_new_tokens=3, ignore_eos=True, **force)])[0]
    assert both.token_ids == [eos] * 5


def test_min_new_tokens_also_holds_stop_sequences_back(llama):
    """As vLLM: a stop sequence counts only once min_new_tokens tokens exist, and only where it ends in
    text produced from then on; an earlier occurrence does not cut the answer short."""
    _, engine = llama
    full = engine.generate([_req(0, PROMPTS[0], max_new_tokens=10)])[0]
    first = engine.generate([_req(0, PROMPTS[0], max_new_tokens=1)])[0].text
    stop = first[:2] if len(first) >= 2 else first
    assert engine.generate([_req(0, PROMPTS[0], max_new_tokens=10, stop=(stop,))])[0].token_ids == full.token_ids[:1]
    held = engine.generate([_req(0, PROMPTS[0], max_new_tokens=10, min_new_tokens=6, stop=(stop,))])[0]
    assert len(held.token_ids) >= 6 and full.text.startswith(held.text)
    five = engine.generate([_req(0, PROMPTS[0], max_new_tokens=5)])[0].text
    if held.finish_reason == "stop":  # a later occurrence may end it, never one inside the first 5 tokens' text
        assert len(held.text) + len(stop) > len(five)


def test_incremental_detokenization_keeps_multibyte_characters_whole(llama):
    _, engine = llama
    text = "héllo 🙂 wörld"
    # Feed the text one byte-level token at a time so that é, 🙂 and ö arrive split across tokens.
    tokenizer = engine.tokenizer
    ids = []
    for char in text:
        for token in tokenizer.tokenize(char):
            ids.extend(tokenizer.convert_tokens_to_ids(list(token)))
    pieces = []
    row = _Row(_req(0, "x", max_new_tokens=len(ids)), [1])
    for token in ids:
        engine.loop._append(row, token, lambda rid, piece: pieces.append(piece.text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(pieces) > 3


def test_safe_prefix_holds_back_a_possible_stop():
    assert _safe_prefix("hello wo", ("world",)) == 6
    assert _safe_prefix("hello", ("xyz",)) == 5
    assert _safe_prefix("ab\ufffd", ()) == 2


def test_return_full_text_and_counts(llama):
    _, engine = llama
    result = engine.generate([_req(0, "the quick", max_new_tokens=4, return_full_text=True)])[0]
    assert result.text.startswith("the quick")
    assert result.prompt_tokens == engine.count_tokens("the quick") > 0
    assert result.generated_tokens == 4


def test_prompt_beyond_the_sequence_length_is_a_value_error(llama):
    _, engine = llama
    prompt = "the quick brown fox " * 40
    n = engine.count_tokens(prompt)
    with pytest.raises(ValueError) as excinfo:
        engine.generate([_req(0, prompt, max_new_tokens=10)])
    assert f"the prompt is {n} tokens and max_new_tokens is 10: {n + 10} exceeds the maximum sequence length 128" \
        in str(excinfo.value)


def test_eos_finishes_a_request(tmp_path):
    checkpoint = make_checkpoint("opt", tmp_path / "ckpt")
    engine = _engine("opt", build_artifact(checkpoint, tmp_path / "art", 1))
    first = engine.generate([_req(0, "the quick", max_new_tokens=3)])[0].token_ids
    engine.loop.eos_token_ids = {first[1]}
    result = engine.generate([_req(0, "the quick", max_new_tokens=3)])[0]
    assert result.finish_reason == "eos"
    assert result.token_ids == first[:1]


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_reduced_precision_tracks_fp32(dtype, tmp_path):
    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    partition_dtype = "int8" if dtype == "int8" else dtype
    engine = _engine("llama", build_artifact(checkpoint, tmp_path / "art", 1, partition_dtype),
                     dtype=dtype)
    reference = _engine("llama", build_artifact(checkpoint, tmp_path / "fp32", 1))
    ids = torch.tensor([engine.tokenizer("the quick brown fox")["input_ids"]])
    with torch.no_grad():
        low = engine.model(input_ids=ids).logits.float()
        high = reference.model(input_ids=ids).logits
    cosine = torch.nn.functional.cosine_similarity(low.flatten(), high.flatten(), dim=0)
    assert cosine > 0.99
    if dtype == "int8":
        q_proj = engine.model.model.layers[0].self_attn.q_proj
        assert q_proj.weight.dtype == torch.int8 and q_proj.weight_scale is not None
    else:
        assert engine.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_a_shard_missing_a_tensor_is_an_artifact_error(tmp_path):
    from safetensors.torch import load_file, save_file

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    artifact = build_artifact(checkpoint, tmp_path / "art", 1)
    shard = artifact / "shards/tp1/rank0.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, shard)
    with pytest.raises(ArtifactError) as excinfo:
        _engine("llama", artifact)
    assert "shard has no tensor 'model.layers.1.mlp.down_proj.weight'" in str(excinfo.value)


def test_a_missing_shard_file_is_an_artifact_error(tmp_path):
    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    artifact = build_artifact(checkpoint, tmp_path / "art", 1)
    engine = create_engine("hf", family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=1,
                           max_sequence_length=64, batch_size=1, device="cpu")
    (artifact / "shards/tp1/rank0.safetensors").unlink()
    with pytest.raises(ArtifactError) as excinfo:
        engine.load(artifact, 0, 1)
    assert "rank0.safetensors: shard file missing" in str(excinfo.value)


@pytest.mark.parametrize("family", ["opt", "gptj"])  # learned / precomputed position tables of 64
def test_a_long_finished_row_never_pushes_a_short_one_past_the_position_table(family, tmp_path):
    """Left padding puts every row at the widest prompt's positions: a 48-token prompt with 2 new
    tokens and a 1-token prompt with 40 would reach position 88 together. The loop runs them
    apart; each is valid alone and decodes to HF generate's tokens."""
    limit = {"max_position_embeddings": 64} if family == "opt" else {"n_positions": 64}
    checkpoint = make_checkpoint(family, tmp_path / "ckpt", **limit)
    engine = _engine(family, build_artifact(checkpoint, tmp_path / "art", 1), max_len=64)
    words = ["fox"]
    while engine.count_tokens(" ".join(words + ["fox"])) <= 48:
        words.append("fox")
    long_prompt = " ".join(words)
    assert 40 <= engine.count_tokens(long_prompt) <= 48
    results = engine.generate([_req(0, long_prompt, max_new_tokens=2), _req(1, "a", max_new_tokens=40)])
    assert results[0].token_ids == hf_greedy(checkpoint, long_prompt, 2)
    assert results[1].token_ids == hf_greedy(checkpoint, "a", 40)


def test_sampling_never_raises_on_degenerate_scores():
    """A failure on rank 0 would leave the other TP ranks waiting in the broadcast: choosing a token
    must not raise for a tiny temperature, NaN logits (an fp16 overflow) or all -inf."""
    logits = torch.tensor([0.5, 3.0, 1.0])
    tiny = GenerationParams(do_sample=True, temperature=1e-45)
    assert choose_token(logits, tiny, [], torch.Generator().manual_seed(0)) == 1
    hot = GenerationParams(do_sample=True, temperature=1e-6)  # 3e6 / ... overflows softmax's input range
    assert choose_token(logits, hot, [], torch.Generator().manual_seed(0)) == 1
    nan = torch.tensor([float("nan"), 1.0, 2.0])
    assert choose_token(nan, GenerationParams(do_sample=True), [], torch.Generator().manual_seed(0)) in (1, 2)
    assert choose_token(nan, GenerationParams(), [], None) == 2
    dead = torch.full((3,), float("-inf"))
    assert choose_token(dead, GenerationParams(do_sample=True), [], torch.Generator().manual_seed(0)) in (0, 1, 2)


def test_a_stop_start_before_an_incomplete_character_is_held_back():
    # " th" + "e" (the stop "eé" may be starting) + an incomplete character: stream " th" only.
    assert _safe_prefix(" the\ufffd", ("eé",)) == 3
    assert _safe_prefix(" the\ufffd", ("x",)) == 4


def _sentencepiece_like_tokenizer():
    """A Llama-2-style tokenizer (Metaspace, byte fallback, a decoder that strips one leading space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    # The trainer made the byte tokens special (added) tokens, which decode(skip_special_tokens=True) drops;
    # in Llama-2's tokenizer they are ordinary vocabulary entries.
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    tok = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _scripted_loop(tokenizer, script):
    """A DecodeLoop whose model step makes `script` (token ids, then EOS) the argmax at each step."""
    from lmc.runtime.engines.generate import DecodeLoop

    eos = tokenizer.convert_tokens_to_ids("</s>")
    vocab = len(tokenizer)

    def prefill(prompts, pad_id):
        step = {"n": 0}

        def logits():
            out = torch.zeros(len(prompts), vocab)
            out[:, (script + [eos])[min(step["n"], len(script))]] = 1.0
            return out

        def advance(tokens):
            step["n"] += 1
            return logits()
        return logits(), advance

    return DecodeLoop(None, tokenizer, max_sequence_length=64, device=torch.device("cpu"), eos_token_ids={eos},
                      prefill=prefill)


def test_sentencepiece_text_keeps_the_leading_space_and_streams_exactly_the_final_text():
    """Decoding the new tokens alone drops the space a Llama-2 tokenizer encodes in '\u2581brown'; they
    are decoded after the prompt's last tokens instead (TGI's offsets), so full text reads right."""
    tokenizer = _sentencepiece_like_tokenizer()
    script = tokenizer(" brown fox", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(script) == "brown fox"  # what decoding the generated ids alone gives
    pieces = []
    result = _scripted_loop(tokenizer, script).generate(
        [GenerationRequest("a", "the quick", GenerationParams(max_new_tokens=20, return_full_text=True))],
        on_token=lambda rid, piece: pieces.append(piece.text))[0]
    assert result.text == "the quick brown fox" and result.finish_reason == "eos"
    assert "".join(pieces) == " brown fox"


def test_byte_fallback_newline_then_a_cut_emoji_streams_what_the_final_text_says():
    tokenizer = _sentencepiece_like_tokenizer()
    byte = tokenizer.convert_tokens_to_ids
    script = tokenizer(" the", add_special_tokens=False)["input_ids"] + [byte("<0x0A>"), byte("<0xF0>"), byte("<0x9F>")]
    pieces = []
    result = _scripted_loop(tokenizer, script).generate(
        [GenerationRequest("a", "fox", GenerationParams(max_new_tokens=len(script)))],
        on_token=lambda rid, piece: pieces.append(piece.text))[0]
    assert result.finish_reason == "length"
    # the newline as soon as it is whole; the cut emoji held back until the end, then as the decoder gives it
    assert pieces == [" the", "\n", "\ufffd\ufffd"] and "".join(pieces) == result.text


def test_streamed_pieces_carry_the_logprobs_of_the_tokens_their_text_covers():
    """A piece whose text waited for later tokens (an emoji in four byte tokens) brings all their logprobs;
    together the pieces list exactly the result's entries, in order, and the EOS none."""
    tokenizer = _sentencepiece_like_tokenizer()
    emoji = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "\U0001F600".encode()]
    script = tokenizer(" the", add_special_tokens=False)["input_ids"] + emoji + tokenizer(" fox", add_special_tokens=False)["input_ids"]
    pieces = []
    result = _scripted_loop(tokenizer, script).generate(
        [GenerationRequest("a", "fox", GenerationParams(max_new_tokens=20, logprobs=2))],
        on_token=lambda rid, piece: pieces.append(piece))[0]
    assert result.finish_reason == "eos" and result.token_ids == script
    streamed = [entry for piece in pieces for entry in piece.logprobs]
    assert streamed == [(token, value, top) for token, (value, top) in zip(result.token_ids, result.logprobs)]
    [carrier] = [piece for piece in pieces if "\U0001F600" in piece.text]
    assert [token for token, _, _ in carrier.logprobs] == emoji
    assert all(len(top) == 2 for _, _, top in streamed)
    assert pieces[-1].last and pieces[-1].logprobs == ()  # the EOS: the finish, no entry
    assert all(piece.logprobs is None for piece in _stream_pieces(tokenizer, script, logprobs=None))


def test_the_cancel_probe_stops_a_row_that_streams_nothing_and_skips_rows_cancelled_before_their_run():
    """Cancellation must not wait for a piece: a row generating special tokens (empty text) never streams."""
    tokenizer = _sentencepiece_like_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<s>")
    calls, pieces = [], []

    def probe():
        calls.append(len(calls))
        return {"a", "gone"} if len(calls) > 3 else {"gone"}  # once before the run, then once per step

    loop = _scripted_loop(tokenizer, [bos] * 30)
    results = loop.generate([GenerationRequest(rid, "fox", GenerationParams(max_new_tokens=30, ignore_eos=True))
                             for rid in ("a", "gone")], on_token=lambda rid, piece: pieces.append(piece), cancel_probe=probe)
    assert pieces == [] and [r.text for r in results] == ["", ""]
    assert [(r.finish_reason, r.generated_tokens) for r in results] == [("cancelled", 2), ("cancelled", 0)]
    assert len(calls) == 4  # the row stopped at the third step's probe, before a third token


def test_rows_cancelled_while_an_earlier_run_decodes_are_never_prefilled():
    """A batch split into runs (max_rows 1): the probe is asked before each run, so a row cancelled while
    the first run decoded is left out of the second, which then does not run at all."""
    tokenizer = _sentencepiece_like_tokenizer()
    loop = _scripted_loop(tokenizer, tokenizer(" the quick", add_special_tokens=False)["input_ids"])
    prefilled, ended = [], []
    inner = loop.prefill

    def prefill(prompts, pad_id):
        prefilled.append(len(prompts))
        return inner(prompts, pad_id)

    loop.prefill = prefill
    results = loop.generate([GenerationRequest(rid, "fox", GenerationParams(max_new_tokens=5)) for rid in ("first", "second")],
                            on_token=lambda rid, piece: piece.last and ended.append(rid),
                            cancel_probe=lambda: {"second"} if ended else set(), max_rows=1)
    assert results[0].finish_reason != "cancelled" and results[0].generated_tokens > 0
    assert (results[1].finish_reason, results[1].generated_tokens) == ("cancelled", 0)
    assert prefilled == [1]


def _stream_pieces(tokenizer, script, logprobs):
    pieces = []
    _scripted_loop(tokenizer, script).generate(
        [GenerationRequest("a", "fox", GenerationParams(max_new_tokens=20, logprobs=logprobs))],
        on_token=lambda rid, piece: pieces.append(piece))
    return pieces


def test_logprob_token_texts_keep_the_leading_space_a_sentencepiece_decoder_strips(tmp_path):
    """TextTools.token_text decodes a token as it reads after other text: '▁brown' is ' brown', not
    'brown', so completions' tokens join up to the answer and top_logprobs keys stay distinct."""
    from lmc.runtime.startup import TextTools

    tokenizer = _sentencepiece_like_tokenizer()
    tokenizer.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    tools = TextTools(tmp_path)
    ids = tokenizer("the quick brown fox", add_special_tokens=False).input_ids
    assert "".join(tokenizer.decode([i]) for i in ids) != " the quick brown fox"  # alone, each loses its space
    assert "".join(tools.token_text(i) for i in ids) == " the quick brown fox"
    assert tools.token_text(tokenizer.convert_tokens_to_ids("</s>")) == "</s>"
