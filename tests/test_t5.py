"""The T5 family's model and its span-corruption samples, on one process.

The layouts are tested against the single process in test_t5_layouts.py; here: what the model
computes (attention masks, relative position buckets against Hugging Face's own T5 function, FLOPs
against torch's FLOP counter) and what a sample holds (megatron-core's span-corruption layout).
"""

import json

import numpy as np
import pytest
import torch

from megalm.data.samples.t5 import MockT5Dataset, T5Specials, t5_sample, t5_specials
from megalm.errors import ConfigError, DataError
from megalm.ops.losses import IGNORE
from megalm.models.t5.model import T5, relative_buckets
from megalm.models.t5.config import T5Config
from megalm.models.t5 import flops_per_token, init_weights

from configs import load
from tiny_t5 import batch, tiny


def model_of(cfg: T5Config, seed: int = 3) -> T5:
    torch.manual_seed(0)
    model = T5(cfg)
    init_weights(model, cfg, seed)
    return model.eval()


@pytest.mark.parametrize("positions", ["learned", "relative"])
def test_padding_is_invisible_and_the_decoder_causal(positions):
    cfg = tiny(position_embedding=positions)
    model = model_of(cfg)
    tokens, padding, decoder = batch(cfg)
    with torch.no_grad():
        out = model(tokens, padding, decoder)
        assert out.shape == (3, cfg.decoder_seq_length, cfg.padded_vocab_size)
        # Whatever the encoder's padded positions hold changes nothing.
        other = tokens.clone()
        other[padding == 0] = 5
        torch.testing.assert_close(model(other, padding, decoder), out, rtol=0, atol=0)
        # A decoder token changes the logits from its position on, never before.
        later = decoder.clone()
        later[:, 6] = 7
        changed = model(tokens, padding, later)
        torch.testing.assert_close(changed[:, :6], out[:, :6], rtol=0, atol=0)
        assert (changed[:, 6:] - out[:, 6:]).abs().max() > 1e-3
        # An encoder token the mask keeps reaches every decoder position (cross-attention).
        moved = tokens.clone()
        moved[2, 3] = 80
        assert (model(moved, padding, decoder)[2, 0] - out[2, 0]).abs().max() > 1e-4


def test_relative_buckets_are_hugging_face_t5s():
    from transformers.models.t5.modeling_t5 import T5Attention
    relative = torch.arange(-300, 301)[None, :] - torch.zeros(1, dtype=torch.long)[:, None]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (16, 40), (8, 20)):
            ours = relative_buckets(relative, bidirectional, buckets, distance)
            theirs = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=buckets,
                                                           max_distance=distance)
            assert torch.equal(ours, theirs), (bidirectional, buckets, distance)


@pytest.mark.parametrize("kw", [dict(), dict(position_embedding="relative", activation="relu", bias=False),
                                dict(encoder_num_layers=1, activation="swiglu", num_query_groups=2),
                                dict(kv_channels=16)])
def test_flops_per_token_is_what_torch_counts(kw):
    """megalm's FLOPs definition (per encoder token) against torch's FLOP counter over a forward and
    backward: both count every matmul (self- and cross-attention scores included) and nothing else."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    cfg = tiny(**kw)
    model = model_of(cfg).train()
    tokens, padding, decoder = batch(cfg, B=2)
    # SDPA's math kernel: attention as plain matmuls, which the counter sees (its CPU kernels it does not).
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens, padding, decoder).float().sum().backward()
    assert counter.get_total_flops() == pytest.approx(flops_per_token(cfg) * tokens.numel(), rel=1e-9)


def test_t5_config_errors_name_the_value():
    with pytest.raises(ConfigError, match="model.position_embedding='rope' is not one of learned, relative"):
        _validate("model.position_embedding=rope")
    with pytest.raises(ConfigError, match="model.encoder_num_layers=4 must leave both stacks a layer"):
        _validate("model.encoder_num_layers=4")
    with pytest.raises(ConfigError, match="data.source='stdlib'"):
        _validate("data=stdlib")


def _validate(*overrides):
    from megalm.validation import validate
    validate(load("model=t5_tiny", "data=mock", *overrides), 1)


# -- samples --------------------------------------------------------------------------------
SPECIALS = T5Specials(bos=1, eos=2, pad=0, sentinels=tuple(range(199, 99, -1)))


def _rebuild(sample, specials=SPECIALS):
    """The original tokens from a sample: each sentinel of the encoder's input replaced by its span,
    read from the decoder's targets."""
    labels = sample["labels"][sample["loss_mask"] > 0].tolist()
    spans, current = {}, None
    for t in labels[:-1]:
        if t in specials.sentinels:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    encoder = sample["tokens"][sample["padding_mask"] > 0].tolist()
    return [t for e in encoder for t in (spans[e] if e in specials.sentinels else [e])], spans


def test_span_corruption_layout():
    tokens = list(range(10, 70))  # 60 tokens, each its own word
    sentences = [tokens[:25], tokens[25:]]
    seen_long = False
    for seed in range(40):
        rng = np.random.RandomState(seed)
        s = t5_sample(sentences, 60, 64, 32, rng, SPECIALS)
        d = int(s["loss_mask"].sum())
        dec, labels = s["decoder_tokens"], s["labels"]
        # The decoder reads [BOS] then its targets shifted by one; the targets end in [EOS].
        assert dec[0] == SPECIALS.bos and labels[d - 1] == SPECIALS.eos
        assert dec[1:d].tolist() == labels[:d - 1].tolist()
        assert (labels[d:] == IGNORE).all() and (dec[d:] == SPECIALS.pad).all()
        rebuilt, spans = _rebuild(s)
        assert rebuilt == tokens  # nothing lost, nothing added
        # Sentinels in order, one a span; 15% of the 60 tokens masked (9), at most.
        order = [t for t in labels[:d].tolist() if t in SPECIALS.sentinels]
        assert order == list(SPECIALS.sentinels[:len(order)])
        masked = sum(len(v) for v in spans.values())
        assert 1 <= masked <= 9
        seen_long |= max(len(v) for v in spans.values()) > 3  # BERT's n-grams stop at 3
        assert s["padding_mask"].sum() == 60 - masked + len(spans)
    assert seen_long


def test_span_corruption_keeps_wordpiece_words_whole():
    # "##" pieces continue the previous word: ids 50-59 continue, so every masked span that holds a
    # piece also holds the word it belongs to.
    continues = np.zeros(200, dtype=bool)
    continues[50:60] = True
    tokens = [10, 50, 51, 11, 12, 52, 13, 53, 54, 55, 14, 15, 56, 16, 57, 17, 18, 58, 19, 20]
    for seed in range(30):
        s = t5_sample([tokens], 20, 24, 16, np.random.RandomState(seed), SPECIALS, continues)
        rebuilt, spans = _rebuild(s)
        assert rebuilt == tokens
        for span in spans.values():
            assert not continues[span[0]]  # a span never starts inside a word
            start = next(i for i in range(len(tokens)) if tokens[i:i + len(span)] == span)
            end = start + len(span)
            assert end == len(tokens) or not continues[tokens[end]]  # nor ends inside one


def test_sample_too_long_for_the_decoder_is_an_error():
    with pytest.raises(DataError, match="model.decoder_seq_length=4"):
        t5_sample([list(range(10, 70))], 60, 64, 4, np.random.RandomState(0), SPECIALS)


def test_mock_samples_are_fixed_by_seed_and_index():
    class Null:
        vocab_size = 256

        def pieces(self):
            return None
    a = MockT5Dataset(Null(), 32, 16, seed=5)
    b = MockT5Dataset(Null(), 32, 16, seed=5)
    assert all(np.array_equal(a[7][k], b[7][k]) for k in a[7])
    assert not np.array_equal(a[7]["tokens"], a[8]["tokens"])
    specials = t5_specials(Null())
    assert specials.sentinels[0] == 255 and specials.sentinels[99] == 156  # Hugging Face T5's order
    assert set(a[3]["tokens"].tolist()) - {0} <= set(range(3, 256))


def test_tokenizer_without_sentinels_is_refused():
    class Pieces:
        identity, origin, vocab_size = "sp:abc", None, 10

        def pieces(self):
            return ["<unk>", "<s>", "</s>", "<pad>"] + ["a"] * 6

        def token_to_id(self, name):
            return {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}.get(name)
    with pytest.raises(DataError, match=r"lacks <extra_id_0>, <extra_id_1>, \.\.\."):
        t5_specials(Pieces())


# -- generation -----------------------------------------------------------------------------
def test_greedy_generation_is_hugging_faces(tmp_path):
    """A random Hugging Face T5, imported: megalm's greedy output (the encoder once, the decoder a token a
    step over its KV cache and the cross-attention keys and values computed once) is transformers' own
    greedy output, with and without the cache."""
    import transformers
    from megalm.convert import import_from_hf
    from megalm.generate import generate_seq2seq_ids
    from megalm.models import build_model
    from megalm.training.checkpoint import load_model_weights
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, feed_forward_proj="gated-silu", tie_word_embeddings=False)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 1.0 if p.ndim == 1 else 0.5)
    hf.save_pretrained(tmp_path / "hf")
    _, cfg = import_from_hf(tmp_path / "hf", tmp_path / "ckpt", seq_length=24)
    model = build_model(cfg).eval()
    load_model_weights(tmp_path / "ckpt" / "step_00000000", model)
    source = [5, 17, 33, 2, 60, 61, 9, 14, 80, 3]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([source]), max_new_tokens=12, do_sample=False, decoder_start_token_id=0,
                          min_new_tokens=12, output_logits=True, return_dict_in_generate=True)
    want = out.sequences[0, 1:].tolist()
    for cache in (True, False):
        got = list(generate_seq2seq_ids(model, source, bos=0, eos=None, max_new_tokens=12, temperature=0,
                                        vocab_size=96, use_cache=cache))
        assert got == want, cache
    # Greedy ids of a random model repeat themselves; the logits of every step match too.
    from megalm.models.layers import KVCache
    with torch.no_grad():
        encoded = model.encode(torch.tensor([source]), torch.ones(1, len(source), dtype=torch.long))
        cache = KVCache(cfg.num_layers, 1, cfg.kv_heads, cfg.decoder_seq_length, cfg.head_dim)
        steps = [0] + want[:-1]
        ours = torch.cat([model.decode(torch.tensor([[t]]), encoded, cache, k)[:, -1, :96] for k, t in enumerate(steps)])
    # The logits against transformers' model in float64: its fp32 logits carry their own rounding (up to 1.6e-4
    # on logits up to 14 here, T5's unscaled attention amplifies it), larger than ours (3.6e-5).
    hf.double()
    with torch.no_grad():
        exact = hf.generate(torch.tensor([source]), max_new_tokens=12, do_sample=False, decoder_start_token_id=0,
                            min_new_tokens=12, output_logits=True, return_dict_in_generate=True)
    assert exact.sequences[0, 1:].tolist() == want
    torch.testing.assert_close(ours, torch.cat(exact.logits).to(ours.dtype), rtol=1e-4, atol=1e-4)  # computed in
    # float64, returned in float32


def test_generation_stops_at_eos_and_the_decoder_length():
    from megalm.generate import generate_seq2seq_ids
    cfg = tiny()
    model = model_of(cfg)
    full = list(generate_seq2seq_ids(model, [5, 6, 7], bos=1, eos=None, max_new_tokens=100, temperature=0))
    assert len(full) == cfg.decoder_seq_length - 1  # the decoder's positions, BOS included, end there
    stop = full[3]
    cut = list(generate_seq2seq_ids(model, [5, 6, 7], bos=1, eos=stop, max_new_tokens=100, temperature=0))
    assert cut == full[:full.index(stop)]


@pytest.mark.parametrize("positions", ["learned", "relative"])
def test_cached_decoding_equals_the_training_forward(positions):
    """The decoder over a KV cache, a chunk then a token at a time, gives the logits of one forward of
    the whole sequence (the training path): positions, the causal bias and the cached keys line up."""
    from megalm.models.layers import KVCache
    cfg = tiny(position_embedding=positions, num_layers=5, encoder_num_layers=2, num_query_groups=2)
    model = model_of(cfg)
    tokens, padding, decoder = batch(cfg, B=2)
    with torch.no_grad():
        full = model(tokens, padding, decoder)
        encoded = model.encode(tokens, padding)
        cache = KVCache(cfg.num_layers, 2, cfg.kv_heads, cfg.decoder_seq_length, cfg.head_dim)
        parts = [model.decode(decoder[:, :4], encoded, cache, 0)]
        parts += [model.decode(decoder[:, t:t + 1], encoded, cache, t) for t in range(4, cfg.decoder_seq_length)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "relative"])
def test_the_servers_slots_decode_together_what_each_source_gives_alone(positions):
    """Seq2SeqEngine (megalm.serve) holds more requests than slots: sources of different lengths enter
    slots as others finish, and the slots decode together, each row at its own position over its own
    source. Each request's greedy output is what generate_seq2seq_ids gives its source alone."""
    import threading
    from megalm.generate import generate_seq2seq_ids
    from megalm.serve.engine import Request, Sampling, Seq2SeqEngine

    class Null:
        vocab_size, eod = 200, 0

        def pieces(self):
            return None

        def decode(self, ids):
            return " ".join(map(str, ids))
    cfg = tiny(position_embedding=positions, num_layers=5, encoder_num_layers=2, num_query_groups=2)
    model = model_of(cfg)
    with torch.no_grad():  # weights far from init's small ones, so that each source has outputs of its own
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    g = torch.Generator().manual_seed(4)
    sources = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (3, 24, 9, 1, 17, 12, 5)]
    asks = [11, 4, 11, 7, 11, 2, 9]
    done, outputs, logprobs = [threading.Event() for _ in sources], [[] for _ in sources], [[] for _ in sources]

    def emit(k):
        def on(kind, value, text, logprob):
            if kind == "token":
                outputs[k].append(value)
                logprobs[k].append(logprob)
            else:
                assert kind == "done", value
                done[k].set()
        return on
    engine = Seq2SeqEngine(model, Null(), slots=3)
    try:
        for k, (source, ask) in enumerate(zip(sources, asks)):
            engine.submit(Request(source, Sampling(max_tokens=ask), emit(k)))
        assert all(d.wait(120) for d in done)
        assert engine.load()["steps"] < sum(asks)  # the slots did decode together
    finally:
        engine.stop(timeout=60)
    for source, ask, got, logprob in zip(sources, asks, outputs, logprobs):
        want = list(generate_seq2seq_ids(model, source, bos=1, eos=2, max_new_tokens=ask, temperature=0,
                                         vocab_size=200))
        assert got == want and len(got) >= 1
        with torch.no_grad():  # the training forward over the whole output gives the same log-probabilities
            src = torch.tensor([source])
            full = model(src, torch.ones_like(src), torch.tensor([[1, *got[:-1]]]))[0, :, :cfg.vocab_size]
        ref = torch.log_softmax(full, -1)[torch.arange(len(got)), got]
        torch.testing.assert_close(torch.tensor(logprob), ref, rtol=1e-5, atol=1e-5)
    assert len({tuple(out) for out in outputs}) == len(outputs)  # each source an output of its own


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory):
    """A t5_tiny run of two steps on mock data (its tokenizer reads and writes ids as numbers)."""
    from megalm.train import run
    run_dir = tmp_path_factory.mktemp("t5_run")
    run(load("model=t5_tiny", "data=mock", "logging.curves=false", "trainer.max_steps=2", "trainer.eval_interval=0",
             "trainer.eval_steps=1", "trainer.progress_bar=false", "trainer.global_batch_size=8"), run_dir, 1)
    return run_dir


def _alone(run_dir, source, max_new_tokens):
    from megalm.generate import generate_seq2seq_ids, load_for_generation
    cfg, model, tok, _ = load_for_generation(run_dir)
    return list(generate_seq2seq_ids(model, source, bos=1, eos=2, max_new_tokens=max_new_tokens, temperature=0,
                                     vocab_size=tok.vocab_size)), cfg, tok


def test_generate_cli_reads_the_prompt_as_the_source(t5_run, capsys):
    from megalm.models.registry import load_run_config
    from megalm.generate import main
    main([str(t5_run), "--prompt", "5 6 7 8", "--temperature", "0", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert "t5_tiny" in err and "source: '5 6 7 8'" in err
    want, _, _ = _alone(t5_run, [5, 6, 7, 8], 6)
    assert out.strip() == " ".join(map(str, want))
    cfg = load_run_config(t5_run)
    room = cfg.model.decoder_seq_length - 1
    main([str(t5_run), "--prompt", "5 6 7 8", "--temperature", "0", "--max-new-tokens", str(room + 5)])
    assert f"# generating at most {room} tokens, not {room + 5}" in capsys.readouterr().err


def test_an_export_generates_with_transformers_as_megalm_generates(tmp_path):
    """config.json carries the ids megalm's generation uses (its tokenizer's BOS to start the decoder, EOS to stop,
    PAD), so transformers' generate() on the export, given nothing but the source, gives megalm's greedy output.
    A t5_tiny run in Hugging Face T5's form (relative positions, RMSNorm, no biases, the head tied)."""
    import transformers
    from megalm.convert import export_to_hf
    from megalm.data.samples.t5 import t5_specials
    from megalm.train import run
    run_dir = tmp_path / "run"
    run(load("model=t5_tiny", "model.position_embedding=relative", "model.normalization=rmsnorm", "model.bias=false",
             "model.head_bias=false", "model.tie_embeddings=true", "data=mock", "logging.curves=false",
             "trainer.max_steps=2", "trainer.eval_interval=0", "trainer.eval_steps=1", "trainer.progress_bar=false",
             "trainer.global_batch_size=8"), run_dir, 1)
    out = export_to_hf(run_dir, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    want, _, tok = _alone(run_dir, [5, 6, 7, 8], 8)
    assert len(want) >= 2  # something to compare
    specials = t5_specials(tok)
    assert (config["decoder_start_token_id"], config["eos_token_id"], config["pad_token_id"]) == \
        (specials.bos, specials.eos, specials.pad) == (1, 2, 0)  # the mock tokenizer's (t5_specials)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        got = hf.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert got[0] == specials.bos
    assert [t for t in got[1:] if t not in (specials.eos, specials.pad)] == want


def test_the_server_answers_with_a_t5_runs_output_for_each_source(t5_run):
    """megalm.serve on a T5 run (a real server process): a completion and Megatron's `text` are the greedy
    output of the prompt as a source, as generated alone; what only a decoder model does (chat, echo,
    scoring, add_BOS) and a source or output too long are 400s naming the field; SIGTERM exits 0."""
    import httpx
    from server_process import start_server, stop_server
    want, cfg, tok = _alone(t5_run, [5, 6, 7, 8], 6)
    assert want
    proc, url = start_server(t5_run)
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "5 6 7 8", "max_tokens": 6, "temperature": 0,
                                                      "logprobs": 0}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tok.decode(want) and len(choice["logprobs"]["token_logprobs"]) == len(want)
        assert r.json()["usage"]["prompt_tokens"] == 4  # the source as it is, no end-of-document token
        r = httpx.put(f"{url}/api", json={"prompts": ["5 6 7 8"], "tokens_to_generate": 6, "top_k": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["text"] == [tok.decode(want)], r.text
        too_long = " ".join(["5"] * (cfg.model.seq_length + 1))
        for method, path, body, param in [
                ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "5 6"}]}, "messages"),
                ("post", "/v1/completions", {"prompt": "5 6", "echo": True}, "echo"),
                ("post", "/v1/completions", {"prompt": too_long}, "prompt"),
                ("post", "/v1/completions", {"prompt": "5 6", "max_tokens": cfg.model.decoder_seq_length}, "max_tokens"),
                ("put", "/api", {"prompts": ["5 6"], "tokens_to_generate": 0}, "tokens_to_generate"),
                ("put", "/api", {"prompts": ["5 6"], "add_BOS": True}, "add_BOS")]:
            r = httpx.request(method.upper(), f"{url}{path}", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": cfg.model.decoder_seq_length - 1,
                                                        "temperature": 0}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        assert stop_server(proc) == 0


# -- fine-tuning pairs (data=sft) -----------------------------------------------------------
def test_pair_sample_layout_and_errors():
    from megalm.data.samples.t5 import pair_sample
    s = pair_sample([10, 11, 12], [20, 21], 6, 4, SPECIALS, "f.jsonl:3")
    assert s["tokens"].tolist() == [10, 11, 12, 0, 0, 0] and s["padding_mask"].tolist() == [1, 1, 1, 0, 0, 0]
    assert s["decoder_tokens"].tolist() == [1, 20, 21, 0]
    assert s["labels"].tolist() == [20, 21, 2, IGNORE] and s["loss_mask"].tolist() == [1, 1, 1, 0]
    with pytest.raises(DataError, match=r"f.jsonl:3: a source of 3 tokens and a target of 4 .*decoder_seq_length=4"):
        pair_sample([10, 11, 12], [20, 21, 22, 23], 6, 4, SPECIALS, "f.jsonl:3")
    with pytest.raises(DataError, match="f.jsonl:3: the target is empty"):
        pair_sample([10], [], 6, 4, SPECIALS, "f.jsonl:3")
    with pytest.raises(DataError, match="f.jsonl:3: the source is empty"):
        pair_sample([], [10], 6, 4, SPECIALS, "f.jsonl:3")


@pytest.mark.parametrize("model", ["t5_tiny", "gpt_tiny"])
def test_parallel_text_files_are_the_pairs_json_lines_hold(tmp_path, model):
    """data.pair_suffixes=[en, fr]: train.en and train.fr, line k of each a pair, give the samples that
    JSON lines of the same pairs give: {prompt, response} for T5, a user / assistant chat (the template
    between source and target) for a decoder. Files of different lengths, a missing file and a bad
    suffix list are errors that name them."""
    import json
    from megalm.data import build_data
    from megalm.models import family_of
    pairs = [("1 2 3", "4 5"), ("6", "7 8 9"), ("10 11", "12"), ("13 14 15 16", "17"), ("5", "6")]
    (tmp_path / "train.en").write_text("".join(f"{a}\n" for a, _ in pairs))
    (tmp_path / "train.fr").write_text("".join(f"{b}\r\n" for _, b in pairs))  # line ends of either kind
    with open(tmp_path / "train.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": a, "response": b} if model == "t5_tiny" else
                               {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]})
                    + "\n")
    common = [f"model={model}", "data=sft", "data.tokenizer.type='null'", "data.tokenizer.vocab_size=256",
              "data.split='60,40,0'", "data.chat_template='{content} 3 '"]  # the null tokenizer reads ids only

    def data(*overrides):
        cfg = load(*common, *overrides)
        family = family_of(cfg.model.arch)
        return build_data(cfg.data, seq_length=cfg.model.seq_length, seed=0,
                          samples=family.samples(cfg.model) if family.samples else None)
    files = data(f"data.paths=[{tmp_path / 'train'}]", "data.pair_suffixes=[en,fr]")
    lines = data(f"data.paths=[{tmp_path / 'train.jsonl'}]")
    for split in ("train", "valid"):
        a, b = getattr(files, split), getattr(lines, split)
        assert len(a) == len(b) > 0
        for k in range(len(a)):
            x, y = a[k], b[k]
            x, y = (x, y) if isinstance(x, dict) else (dict(enumerate(x)), dict(enumerate(y)))
            assert x.keys() == y.keys() and all(np.array_equal(x[n], y[n]) for n in x), (split, k)
    (tmp_path / "short.en").write_text("1\n2\n3\n")
    (tmp_path / "short.fr").write_text("1\n2\n")
    with pytest.raises(DataError, match=r"short.en has 3 lines and .*short.fr 2"):
        data(f"data.paths=[{tmp_path / 'short'}]", "data.pair_suffixes=[en,fr]")
    with pytest.raises(DataError, match=r"train.de does not exist .*reads train.en and train.de"):
        data(f"data.paths=[{tmp_path / 'train'}]", "data.pair_suffixes=[en,de]")
    with pytest.raises(ConfigError, match=r"data.pair_suffixes=\['en'\] must be two file suffixes"):
        data(f"data.paths=[{tmp_path / 'train'}]", "data.pair_suffixes=[en]")
    (tmp_path / "blank.en").write_text("1\n2\n")
    (tmp_path / "blank.fr").write_text("1\n\n")
    with pytest.raises(DataError, match=r"blank.en:2 \(blank.fr:2\): the target is empty"):
        data(f"data.paths=[{tmp_path / 'blank'}]", "data.pair_suffixes=[en,fr]")


def test_t5_learns_pairs_from_json_lines(tmp_path):
    """data=sft with T5: each line a (source, target) pair. The source is one id (of 18) repeated, the
    target that id, then [EOS]: a decoder that does not read the source can do no better than
    log(18) / 2 = 1.45 a token, so a validation loss far below that is the encoder's output reaching it."""
    import json
    from megalm.train import run
    g = np.random.default_rng(0)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(200):
            src = [int(g.integers(3, 21))] * int(g.integers(3, 12))
            f.write(json.dumps({"prompt": " ".join(map(str, src)), "response": str(src[0])}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "1"}]}) + "\n")
    common = ["model=t5_tiny", "data=sft", f"data.paths=[{tmp_path / 'pairs.jsonl'}]", "data.tokenizer.type='null'",
              "data.tokenizer.vocab_size=256", "logging.curves=false", "trainer.eval_interval=0", "trainer.eval_steps=2",
              "trainer.progress_bar=false", "trainer.global_batch_size=16", "trainer.micro_batch_size=16",
              "data.split='90,10,0'", "optimizer.lr=3e-3", "optimizer.warmup_steps=5"]
    with pytest.raises(DataError, match=r"pairs.jsonl:201: an encoder-decoder example is"):
        run(load(*common, "trainer.max_steps=2"), tmp_path / "refused", 1)
    lines = (tmp_path / "pairs.jsonl").read_text().splitlines()[:-1]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    loss = run(load(*common, "trainer.max_steps=120"), tmp_path / "run", 1)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert next(r["val_loss"] for r in records if "val_loss" in r) > 2.0  # it started knowing nothing
    assert loss < 0.7
    # megalm.evaluate's generate task decodes each source (the encoder once, greedy from BOS to EOS) and
    # scores the outputs: most are right, where chance is 1 in 18.
    from megalm.evaluate import evaluate
    with open(tmp_path / "eval.jsonl", "w") as f:
        for k in range(3, 21):
            f.write(json.dumps({"prompt": " ".join([str(k)] * 5), "reference": str(k)}) + "\n")
    result = evaluate(tmp_path / "run", "generate", tmp_path / "eval.jsonl")
    assert result["examples"] == 18 and result["exact_match"] > 0.5, result
    with pytest.raises(ConfigError, match="encoder-decoder run .*its task is generate"):
        evaluate(tmp_path / "run", "perplexity", tmp_path / "eval.jsonl")


def test_a_source_the_encoder_cannot_take_is_refused():
    from megalm.generate import generate_seq2seq_ids
    cfg = tiny()
    model = model_of(cfg)
    with pytest.raises(ConfigError, match=r"the source is 25 tokens; the encoder takes model.seq_length=24 at most"):
        list(generate_seq2seq_ids(model, [5] * 25, bos=1, eos=2, max_new_tokens=3))
    with pytest.raises(ConfigError, match=r"token id 300, outside the vocabulary of 200 ids"):
        list(generate_seq2seq_ids(model, [5, 300], bos=1, eos=2, max_new_tokens=3))


def test_the_server_refuses_a_t5_layout_before_starting_ranks(t5_run, capsys):
    from megalm.serve import main
    with pytest.raises(SystemExit) as e:
        main([str(t5_run), "--tp", "2"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "model.arch=t5" in err and "one process: drop --tp / --pp" in err
