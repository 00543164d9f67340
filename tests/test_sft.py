"""Supervised fine-tuning (data=sft): samples with the loss on responses only, fine-tuning from a
pretrained run's weights, and the same losses at tp2, pp2 and dp2 (ZeRO-1) as in one process.

The first step's loss is checked against a plain computation: the pretrained weights (loaded by
the generation path) on the first global batch, cross-entropy averaged over response tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megalm.errors import ConfigError, DataError
from configs import load
from layouts import run_layouts

STEPS = 4


def _examples():
    rng = np.random.default_rng(0)
    out = []
    for k in range(80):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        if k % 3:
            out.append({"prompt": f"{a} + {b} =", "response": f" {a + b}"})
        else:
            out.append({"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a} + {b}"},
                                     {"role": "assistant", "content": str(a + b)}]})
    return out


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in _examples()))
    return path


def _base(run_dir, sft_path):
    return ["model=gpt_tiny", "model.vocab_size=1024", "data=sft", f"data.paths=[{sft_path}]",
            f"data.tokenizer.model={run_dir / 'tokenizer.model'}", f"checkpoint.load={run_dir / 'checkpoints'}",
            "checkpoint.finetune=true", "checkpoint.save=false", "trainer.micro_batch_size=2",
            "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.eval_interval=0",
            "trainer.eval_steps=1", "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1",
            "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "cluster.peak_flops=1e12"]


def test_samples_learn_the_response_and_its_end_only(run, sft_file):
    from megalm.data.tasks.sft import SFTDataset, encode_example, example_pieces
    _, _, tok = run
    ids, learned = encode_example(example_pieces({"prompt": "2 + 3 =", "response": " 5"}, "{role}: {content}\n", "x"),
                                  tok, 32, "x")
    want = [tok.eod] + tok.encode("2 + 3 =") + tok.encode(" 5") + [tok.eod]
    assert ids.tolist() == want + [tok.eod] * (33 - len(want))
    assert learned.tolist() == [False] * (1 + len(tok.encode("2 + 3 ="))) + [True] * (len(tok.encode(" 5")) + 1) + \
        [False] * (33 - len(want))
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ids, learned = encode_example(example_pieces(chat, "<{role}> {content};", "x"), tok, 32, "x")
    pieces = [tok.encode("<user> "), tok.encode("hi;"), tok.encode("<assistant> "), tok.encode("yo;")]
    assert ids[:1 + sum(map(len, pieces)) + 1].tolist() == [tok.eod] + sum(pieces, []) + [tok.eod]
    assert tok.decode(ids[learned]) == tok.decode(tok.encode("yo;") + [tok.eod])
    sample = SFTDataset([(ids, learned)], "train", 1, 3)[2]
    from megalm.ops.losses import IGNORE
    assert sample["tokens"].tolist() == ids[:-1].tolist()
    assert sample["labels"].tolist() == np.where(learned[1:], ids[1:], IGNORE).tolist()
    assert sample["loss_mask"].tolist() == learned[1:].astype(float).tolist()


def test_epochs_are_permutations_and_samples_depend_on_their_index_only():
    from megalm.data.tasks.sft import SFTDataset
    examples = [(np.full(5, k), np.ones(5, bool)) for k in range(7)]
    ds = SFTDataset(examples, "train", seed=3, num_samples=21)
    order = [int(ds[i]["tokens"][0]) for i in range(21)]
    assert all(sorted(order[e * 7:(e + 1) * 7]) == list(range(7)) for e in range(3))
    assert order[:7] != order[7:14]  # a fresh order each epoch
    again = SFTDataset(examples, "train", seed=3, num_samples=21)
    assert [int(again[i]["tokens"][0]) for i in (20, 3, 11)] == [order[20], order[3], order[11]]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"}', r"x.jsonl:2: needs string fields 'prompt' and 'response' .* 'response' missing"),
    ('{"prompt": "a", "response": ""}', r"x.jsonl:2: the response is empty"),
    ('not json', r"x.jsonl:2: not JSON"),
    ('{"messages": [{"role": "user", "content": "a"}]}', r"x.jsonl:2: the chat has no assistant message"),
    ('{"messages": [{"role": "bot", "content": "a"}]}', r"x.jsonl:2: message 0 must be .*system, user, assistant"),
    ('{"prompt": "' + "word " * 60 + '", "response": "b"}', r"x.jsonl:2: the example is \d+ tokens .* at most 33"),
    ('{"prompt": "a", "response": "b", "messages": [{"role": "assistant", "content": "c"}]}',
     r"x.jsonl:2: an example is either a chat \('messages'\) or a prompt / response pair; this one has 'messages' "
     r"and 'prompt' and 'response'"),
])
def test_bad_examples_name_file_and_line(run, tmp_path, line, message):
    from megalm.data.tasks.sft import read_examples
    _, _, tok = run
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "response": "b"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        read_examples([str(tmp_path / "x.jsonl")], tok, 32, "{role}: {content}\n")


def test_bad_sft_configs(run, sft_file):
    from megalm.validation import validate
    run_dir, _, _ = run
    base = _base(run_dir, sft_file)
    validate(load(*base), 1)
    for extra, message in ((["data.chat_template=no content"], r"must hold \{content\} exactly once"),
                           (["data.paths=[]"], r"data.source=sft reads JSON-lines files"),
                           (["data.tokenizer.model=null"], r"needs the tokenizer the model was trained with"),
                           (["model=bert_tiny"], r"BERT \(model.arch=bert\) does not generate")):
        with pytest.raises(ConfigError, match=message):
            validate(load(*base, *extra), 1)


LAYOUTS = [["parallel=tp2", "parallel.sequence_parallel=true"], ["parallel=pp2", "parallel.pipeline_schedule=1f1b"],
           ["parallel=dp2", "parallel.zero_stage=1"]]


def _losses(d: Path):
    return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture(scope="module")
def sft_runs(run, sft_file, tmp_path_factory):
    from megalm.train import run as train_run
    from megalm.validation import validate
    run_dir, _, _ = run
    root = tmp_path_factory.mktemp("sft_runs")
    cfg = load(*_base(run_dir, sft_file))
    validate(cfg, 1)
    train_run(cfg, root / "single", 1)
    jobs = [([*_base(run_dir, sft_file), *layout], str(root / f"layout{i}")) for i, layout in enumerate(LAYOUTS)]
    run_layouts(2, jobs, timeout=300.0 * len(jobs))
    return root, cfg


def test_first_step_is_the_pretrained_model_on_response_tokens(run, sft_runs):
    from megalm.data import build_data, collate
    from megalm.generate import load_for_generation
    run_dir, _, _ = run
    root, cfg = sft_runs
    _, model, tok, _ = load_for_generation(run_dir)
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=cfg.trainer.seed, tokenizer=tok,
                      num_samples={"train": 8 * STEPS})
    means = []
    with torch.no_grad():
        for first in range(0, 8, 2):  # the first global batch, micro-batch by micro-batch
            batch = collate([data.train[i] for i in (first, first + 1)])
            logp = torch.log_softmax(model(batch["tokens"])[..., :cfg.model.vocab_size].double(), dim=-1)
            nll = -logp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
            mask = batch["loss_mask"].double()
            assert mask.sum() > 0 and (mask < 1).any()  # prompts and padding are not learned
            means.append(float((nll * mask).sum() / mask.sum()))
    assert _losses(root / "single")[0] == pytest.approx(np.mean(means), rel=1e-5)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_sft_at_a_layout_matches_the_single_process(sft_runs, index):
    root, _ = sft_runs
    single, layout = _losses(root / "single"), _losses(root / f"layout{index}")
    assert len(single) == len(layout) == STEPS
    np.testing.assert_allclose(layout, single, rtol=1e-5)
    assert single[-1] < single[0]  # it learns


# ---------------------------------------------------------------- packing

def test_pack_examples_keeps_examples_whole_and_in_order():
    from megalm.data.tasks.sft import pack_examples
    examples = []
    for n in (5, 4, 9, 3, 3, 10):
        learned = np.zeros(11, bool)
        learned[n - 2:n] = True  # the answer and the final eod; then padding
        examples.append((np.arange(100 * n, 100 * n + 11), learned))
    rows = pack_examples(examples, 10, pad=7)
    assert [r[3].max() for r in rows] == [2, 1, 2, 1]  # 5+4 (+9 > 11) | 9 (+3 > 11) | 3+3 (+10 > 11) | 10
    ids, learned, positions, segments = rows[0]
    assert ids.tolist() == list(range(500, 505)) + list(range(400, 404)) + [7, 7]
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0] and segments.tolist() == [1] * 5 + [2] * 4 + [0, 0]
    assert learned.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2 + [False] * 2


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_packed_examples_score_as_if_alone(style, run):
    """Every learned token of packed examples gets the log-probability it gets in its example alone:
    positions restart and attention stays inside each example (learned positions and RoPE, GQA)."""
    from megalm.data.tasks.sft import SFTDataset, encode_example, example_pieces, pack_examples
    from megalm.models import build_model, init_weights
    _, _, tok = run
    extra = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
             "model.num_query_groups=2", "model.tie_embeddings=false"] if style == "llama" else []
    cfg = load("model=gpt_tiny", "model.vocab_size=1024", "data=mock", *extra).model
    model = build_model(cfg).double().eval()
    init_weights(model, cfg, 5)
    examples = [encode_example(example_pieces(e, "{role}: {content}\n", "x"), tok, 32, "x") for e in _examples()[:12]]
    rows = pack_examples(examples, 32, tok.eod)
    assert len(rows) < len(examples) and max(int(r[3].max()) for r in rows) >= 2

    def token_logprobs(dataset):
        out = []
        with torch.no_grad():
            for i in range(len(dataset)):
                s = {k: torch.from_numpy(np.asarray(v))[None] for k, v in dataset[i].items()}
                packed = (s["position_ids"], s["segment_ids"]) if "segment_ids" in s else ()
                logp = torch.log_softmax(model(s["tokens"], *packed)[..., :cfg.vocab_size], dim=-1)
                keep = s["loss_mask"][0] > 0
                out += logp[0][keep].gather(-1, s["labels"][0][keep][:, None])[:, 0].tolist()
        return out

    alone = token_logprobs(SFTDataset(examples, "train", 0, len(examples)))
    together = token_logprobs(SFTDataset(rows, "train", 0, len(rows)))
    assert len(alone) == len(together) > 20
    np.testing.assert_allclose(sorted(together), sorted(alone), rtol=1e-9)  # the same tokens, in another order


@pytest.fixture(scope="module")
def packed_runs(run, sft_file, tmp_path_factory):
    from megalm.train import run as train_run
    run_dir, _, _ = run
    root = tmp_path_factory.mktemp("sft_packed")
    base = [*_base(run_dir, sft_file), "data.packing=true"]
    train_run(load(*base), root / "single", 1)
    jobs = [([*base, *layout], str(root / f"layout{i}")) for i, layout in enumerate(LAYOUTS)]
    run_layouts(2, jobs, timeout=300.0 * len(jobs))
    return root


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_packed_sft_at_a_layout_matches_the_single_process(packed_runs, sft_runs, index):
    single, layout = _losses(packed_runs / "single"), _losses(packed_runs / f"layout{index}")
    assert len(single) == len(layout) == STEPS
    np.testing.assert_allclose(layout, single, rtol=1e-5)
    unpacked = _losses(sft_runs[0] / "single")
    assert single != unpacked  # a packed batch holds more examples
