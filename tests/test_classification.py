"""BERT fine-tuned as a sequence classifier (data=classification, model.num_labels): GLUE's file
layouts, Megatron's [CLS] a [SEP] b [SEP] samples, a start from a pretrained BERT run (encoder
loaded, classifier fresh, pretraining heads left out) and the same losses at tp2+sp, pp2 and dp2
ZeRO-1 as in one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_ranks
from megalm.data.bert_dataset import Specials, pair_sample
from megalm.data.classification import Example, read_examples
from megalm.errors import ConfigError, DataError
from test_parallel_model import _rank_runs, load

STEPS = 4


def _write(path: Path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_glue_layouts(tmp_path):
    mnli = _write(tmp_path / "mnli.tsv", ["index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1"
                                          "\tgold_label", "0\t1\t2\tg\tx\tx\tx\tx\tA man.\tA person.\tentailment\tentailment",
                                          "1\t1\t2\tg\tx\tx\tx\tx\tA dog.\tNo dog.\tcontradiction\tcontradiction"])
    assert read_examples([mnli], "mnli", [], 3) == [Example("A man.", "A person.", 1), Example("A dog.", "No dog.", 0)]
    cola = _write(tmp_path / "cola.tsv", ["gj04\t1\t\tThe book was read.", "gj04\t0\t*\tBook the read was."])
    assert read_examples([cola], "cola", [], 2) == [Example("The book was read.", None, 1),
                                                    Example("Book the read was.", None, 0)]
    sst = _write(tmp_path / "sst.tsv", ["sentence\tlabel", "a great film \t1", "dull\t0"])
    assert read_examples([sst], "sst2", [], 2) == [Example("a great film ", None, 1), Example("dull", None, 0)]
    stsb = _write(tmp_path / "stsb.tsv", ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
                                          "sentence2\tscore", "0\tm\tf\t2012\t1\tnone\tnone\tA plane.\tAn airplane.\t5.000"])
    assert read_examples([stsb], "stsb", [], 1) == [Example("A plane.", "An airplane.", 5.0)]
    qqp = _write(tmp_path / "qqp.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t2\t3\tWhy?\tHow?\t0"])
    assert read_examples([qqp], "qqp", [], 2) == [Example("Why?", "How?", 0)]
    jsonl = _write(tmp_path / "x.jsonl", [json.dumps({"text": "a", "label": "pos"}),
                                          json.dumps({"text": "b", "text_pair": "c", "label": "neg"})])
    assert read_examples([jsonl], "jsonl", ["neg", "pos"], 2) == [Example("a", None, 1), Example("b", "c", 0)]


@pytest.mark.parametrize("task, lines, labels, num_labels, message", [
    ("mnli", ["sentence1\tsentence2\tgold_label", "a\tb\tmaybe"], [], 3,
     r"mnli.tsv:2: label 'maybe' is not one of contradiction, entailment, neutral"),
    ("sst2", ["sentence\tlabel", "a"], [], 2, r"sst2.tsv:2: 1 columns, the sst2 layout needs 2"),
    ("sst2", ["index\tsentence", "0\ta"], [], 2, r"sst2.tsv:1: the sst2 header lacks label .*a test file"),
    ("jsonl", ['{"text": "a", "label": 5}'], [], 2, r"jsonl.tsv:1: label 5 is not one of 0..1"),
    ("jsonl", ['{"text": "a"}'], [], 2, r"jsonl.tsv:1: needs 'text' .* and 'label'"),
    ("stsb", ["sentence1\tsentence2\tscore", "a\tb\thigh"], [], 1, r"stsb.tsv:2: label 'high' is not a number"),
])
def test_bad_examples_name_file_and_line(tmp_path, task, lines, labels, num_labels, message):
    path = _write(tmp_path / f"{task}.tsv", lines)
    with pytest.raises(DataError, match=message):
        read_examples([path], task, labels, num_labels)


def test_pair_samples_trim_the_longer_text_first():
    s = Specials(cls=1, sep=2, mask=3, pad=0)
    out = pair_sample(list(range(10, 20)), [30, 31, 32], 1, 12, s)  # 10 + 3 > 12 - 3: trim a to 6
    assert out["tokens"].tolist() == [1, 10, 11, 12, 13, 14, 15, 2, 30, 31, 32, 2]
    assert out["token_types"].tolist() == [0] * 8 + [1] * 4 and out["padding_mask"].sum() == 12
    out = pair_sample([10, 11, 12], [30, 31, 32, 33, 34, 35, 36], 0, 9, s)  # b is the longer: trim it to 3
    assert out["tokens"].tolist() == [1, 10, 11, 12, 2, 30, 31, 32, 2]
    out = pair_sample([10, 11], None, 2.5, 6, s)
    assert out["tokens"].tolist() == [1, 10, 11, 2, 0, 0] and out["padding_mask"].tolist() == [1, 1, 1, 1, 0, 0]
    assert out["label"].dtype == np.float32 and (out["token_types"] == 0).all()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A bert_tiny pretrained a few steps on the stdlib's docstrings, with its own tokenizer."""
    from megalm.train import run
    root = tmp_path_factory.mktemp("bert_pretrained")
    run(load("model=bert_tiny", "model.vocab_size=1024", "data=stdlib_prose", "data.max_corpus_mb=1",
             "data.tokenizer.vocab_size=1000", f"data.cache_dir={root / 'cache'}", "trainer.max_steps=10",
             "trainer.eval_interval=0", "trainer.eval_steps=1", "trainer.progress_bar=false",
             "cluster.peak_flops=1e12"), root / "run", 1)
    return root / "run"


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    """SST-2's layout over short made-up reviews whose label a word decides."""
    rng = np.random.default_rng(0)
    good, bad = ["great", "good", "lovely", "fine"], ["awful", "bad", "dull", "poor"]
    rows = ["sentence\tlabel"]
    for _ in range(120):
        label = int(rng.integers(0, 2))
        word = (good if label else bad)[int(rng.integers(0, 4))]
        rows.append(f"the film was {word} and the actors were there\t{label}")
    root = tmp_path_factory.mktemp("sst")
    return _write(root / "train.tsv", rows[:97]), _write(root / "dev.tsv", rows[:1] + rows[97:])


def _base(run_dir, sentiment):
    train, dev = sentiment
    return ["model=bert_tiny", "model.vocab_size=1024", "model.num_labels=2", "data=classification",
            "data.task=sst2", f"data.paths=[{train}]", f"data.valid_paths=[{dev}]",
            f"data.tokenizer.model={run_dir / 'tokenizer.model'}", f"checkpoint.load={run_dir / 'checkpoints'}",
            "checkpoint.finetune=true", "checkpoint.save=false", "trainer.micro_batch_size=2",
            "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.eval_interval=0",
            "trainer.eval_steps=2", "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1",
            "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "cluster.peak_flops=1e12"]


LAYOUTS = [["parallel=tp2", "parallel.sequence_parallel=true"], ["parallel=pp2", "parallel.pipeline_schedule=1f1b"],
           ["parallel=dp2", "parallel.zero_stage=1"]]


def _records(d: Path):
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]


@pytest.fixture(scope="module")
def runs(pretrained, sentiment, tmp_path_factory):
    from megalm.train import run
    from megalm.validation import validate
    root = tmp_path_factory.mktemp("classify_runs")
    cfg = load(*_base(pretrained, sentiment), "checkpoint.save=true")  # megalm.evaluate reads it
    validate(cfg, 1)
    run(cfg, root / "single", 1)
    jobs = [([*_base(pretrained, sentiment), *layout], str(root / f"layout{i}")) for i, layout in enumerate(LAYOUTS)]
    run_ranks(2, _rank_runs, jobs, timeout=300.0 * len(jobs))
    return root, cfg


def test_first_step_is_the_pretrained_encoder_with_a_fresh_classifier(pretrained, runs):
    """Reference: a classifier model initialised by name, then every parameter it shares with the
    pretraining model copied over by hand, on the first global batch."""
    import torch.nn.functional as F
    from megalm.data import build_data, collate, load_tokenizer
    from megalm.data.bert_dataset import BertSamples
    from megalm.generate import load_for_generation
    from megalm.models import build_model, init_weights
    root, cfg = runs
    _, old, _, _ = load_for_generation(pretrained)
    model = build_model(cfg.model)
    init_weights(model, cfg.model, cfg.trainer.seed)
    old_params = dict(old.named_parameters())
    shared = [n for n, _ in model.named_parameters() if n in old_params]
    assert shared and all(not n.startswith("classifier") for n in shared)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in old_params:
                p.copy_(old_params[name])
    model.eval()  # the trainer's dropout is off: bert_tiny has none
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=cfg.trainer.seed,
                      tokenizer=load_tokenizer(pretrained), num_samples={"train": 8 * STEPS, "valid": 16},
                      samples=BertSamples(cfg.model))
    losses = []
    with torch.no_grad():
        for first in range(0, 8, 2):
            b = collate([data.train[i] for i in (first, first + 1)])
            losses.append(float(F.cross_entropy(model(b["tokens"], b["token_types"], b["padding_mask"]), b["label"])))
    train, _ = _records(root / "single")
    assert train[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert "acc" in train[0] and train[-1]["loss"] < train[0]["loss"]


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_classifier_at_a_layout_matches_the_single_process(runs, index):
    root, _ = runs
    (single, single_val), (layout, layout_val) = _records(root / "single"), _records(root / f"layout{index}")
    assert len(single) == len(layout) == STEPS
    for key in ("loss", "acc"):
        np.testing.assert_allclose([r[key] for r in layout], [r[key] for r in single], rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in layout_val], [r["val_loss"] for r in single_val], rtol=1e-5)


def test_bad_classification_configs(pretrained, sentiment):
    from megalm.validation import validate
    base = _base(pretrained, sentiment)
    for extra, message in ((["model.num_labels=3"], r"data.task=sst2 has 2 label\(s\) .* model.num_labels=3"),
                           (["data=mock"], r"model.num_labels=2 fine-tunes a classifier .* data=classification"),
                           (["data.task=glue"], r"data.task='glue' is not one of jsonl, mnli")):
        with pytest.raises(ConfigError, match=message):
            validate(load(*base, *extra), 1)
    gpt = [o for o in base if not o.startswith("model.num_labels")] + ["model=gpt_tiny"]
    with pytest.raises(ConfigError, match=r"GPT has no classification head yet"):
        validate(load(*gpt), 1)


def test_classify_metrics_equal_their_definitions():
    from megalm.evaluate.classify import metrics
    rng = np.random.default_rng(1)
    y, p = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    tp, tn = int(((p == 1) & (y == 1)).sum()), int(((p == 0) & (y == 0)).sum())
    fp, fn = int(((p == 1) & (y == 0)).sum()), int(((p == 0) & (y == 1)).sum())
    got = metrics("jsonl", p, y, 2)
    assert got["accuracy"] == (tp + tn) / 200
    assert got["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert got["mcc"] == pytest.approx((tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    assert set(metrics("sst2", p, y, 2)) == {"accuracy"} and set(metrics("cola", p, y, 2)) == {"accuracy", "mcc"}
    y3, p3 = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    f1s = []
    for c in range(3):
        t, f_p, f_n = ((p3 == c) & (y3 == c)).sum(), ((p3 == c) & (y3 != c)).sum(), ((p3 != c) & (y3 == c)).sum()
        f1s.append(2 * t / (2 * t + f_p + f_n))
    assert metrics("mnli", p3, y3, 3)["macro_f1"] == pytest.approx(np.mean(f1s))
    v, w = rng.normal(size=50), rng.normal(size=50)
    reg = metrics("stsb", v, w, 1)
    ranks = lambda a: np.argsort(np.argsort(a))  # noqa: E731  (no ties in normal draws)
    assert reg["pearson"] == pytest.approx(np.corrcoef(v, w)[0, 1])
    assert reg["spearman"] == pytest.approx(np.corrcoef(ranks(v), ranks(w))[0, 1])
    assert reg["mse"] == pytest.approx(np.mean((v - w) ** 2))


def test_evaluate_classify_scores_the_fine_tuned_run(runs, sentiment, pretrained):
    from megalm.data.bert_dataset import bert_specials
    from megalm.evaluate import evaluate
    from megalm.generate import load_for_generation
    root, _ = runs
    _, dev = sentiment
    got = evaluate(root / "single", "classify", dev)
    _, model, tok, _ = load_for_generation(root / "single")
    examples = read_examples([dev], "sst2", [], 2)
    right = 0
    with torch.no_grad():
        for e in examples:
            s = pair_sample(tok.encode(e.text), None, e.label, 32, bert_specials(tok))
            logits = model(*(torch.from_numpy(s[k])[None] for k in ("tokens", "token_types", "padding_mask")))
            right += int(int(logits.argmax(-1)) == e.label)
    assert got["examples"] == len(examples) == 24 and got["accuracy"] == right / len(examples)
    assert json.loads((root / "single" / "eval" / "classify_dev.json").read_text())["accuracy"] == got["accuracy"]
    with pytest.raises(ConfigError, match="scores a fine-tuned classifier"):
        evaluate(pretrained, "classify", dev)
