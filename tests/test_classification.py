"""Fine-tuning heads on labelled examples (data=classification): BERT and GPT classifiers
(model.num_labels) and multiple choice (model.num_choices). GLUE's and RACE's file layouts,
Megatron's [CLS] a [SEP] b [SEP] samples and GPT's a <eod> b <eod> read at the last real token, a
start from a pretrained run (encoder loaded, head fresh, pretraining heads left out) and the same
losses at tp2+sp, pp2 and dp2 ZeRO-1 as in one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megalm.data.samples.bert import pair_sample
from megalm.data.tokenizers.specials import Specials
from megalm.data.tasks.classification import Example, read_examples
from megalm.errors import ConfigError, DataError
from configs import load
from layouts import run_layouts

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
    ("stsb", ["sentence1\tsentence2\tscore", "a\tb\t1.5", "c\td\tinf"], [], 1,
     r"stsb.tsv:3: label 'inf' is not a finite number"),
    ("jsonl", ['{"text": "a", "label": NaN}'], [], 1, r"jsonl.tsv:1: label nan is not a finite number"),
])
def test_bad_examples_name_file_and_line(tmp_path, task, lines, labels, num_labels, message):
    path = _write(tmp_path / f"{task}.tsv", lines)
    with pytest.raises(DataError, match=message):
        read_examples([path], task, labels, num_labels)


def test_a_class_named_twice_or_for_a_task_with_its_own_is_refused():
    with pytest.raises(ConfigError, match=r"data.labels=\['pos', 'pos'\] names pos more than once"):
        read_examples([], "jsonl", ["pos", "pos"], 2)
    with pytest.raises(ConfigError, match=r"data.labels=\['neg', 'pos'\] names the classes of data.task=jsonl or "
                                          r"fasttext; data.task=sst2 has its own \(0, 1\): leave data.labels empty"):
        read_examples([], "sst2", ["neg", "pos"], 2)


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
def pretrained(bert_run):
    return bert_run


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


TP, PP, DP = (["parallel=tp2", "parallel.sequence_parallel=true"], ["parallel=pp2", "parallel.pipeline_schedule=1f1b"],
              ["parallel=dp2", "parallel.zero_stage=1"])
LAYOUTS = [TP, PP, DP]


@pytest.fixture(scope="module")
def choices(tmp_path_factory):
    """Multiple choice over the same made-up reviews: which of two continuations fits (data.task=choice)."""
    rng = np.random.default_rng(1)
    good, bad = ["great", "good", "lovely", "fine"], ["awful", "bad", "dull", "poor"]
    rows = []
    for _ in range(80):
        positive, right = int(rng.integers(0, 2)), int(rng.integers(0, 2))
        word = (good if positive else bad)[int(rng.integers(0, 4))]
        options = ["so I liked it", "so I left early"] if positive else ["so I left early", "so I liked it"]
        rows.append(json.dumps({"context": f"the film was {word} and the actors were there",
                                "choices": options if right == 0 else options[::-1], "label": right}))
    root = tmp_path_factory.mktemp("choice")
    return _write(root / "train.jsonl", rows[:64]), _write(root / "dev.jsonl", rows[64:])


def _gpt(gpt_run, data, head):
    """GPT fine-tuning overrides: the session's pretrained gpt_tiny run, `data` = (train, dev) files."""
    train, dev = data
    task = ["model.num_labels=2", "data.task=sst2"] if head == "labels" else ["model.num_choices=2", "data.task=choice"]
    return ["model=gpt_tiny", "model.vocab_size=1024", *task, "data=classification", f"data.paths=[{train}]",
            f"data.valid_paths=[{dev}]", f"data.tokenizer.model={gpt_run / 'tokenizer.model'}",
            f"checkpoint.load={gpt_run / 'checkpoints'}", "checkpoint.finetune=true", "checkpoint.save=false",
            "trainer.micro_batch_size=2", "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}",
            "trainer.eval_interval=0", "trainer.eval_steps=2", "trainer.log_interval=1", "trainer.progress_bar=false",
            "trainer.num_threads=1", "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "cluster.peak_flops=1e12"]


def _bert_choice(run_dir, data):
    # SGD: the fresh scorer gives both choices nearly one score, and Adam would turn the first step's
    # near-zero gradients into full-size updates whose sign is rounding (layouts sum in another order)
    base = [o for o in _base(run_dir, data) if not o.startswith(("model.num_labels", "data.task"))]
    return [*base, "model.num_choices=2", "data.task=choice", "optimizer=sgd", "optimizer.lr=0.5"]


# (name, layouts) of each fine-tuning run the layout tests compare with its single-process run
HEADS = {"bert_labels": LAYOUTS, "gpt_labels": LAYOUTS, "bert_choice": [TP, PP], "gpt_choice": [DP, TP]}


def _records(d: Path):
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]


@pytest.fixture(scope="module")
def runs(pretrained, sentiment, choices, run, tmp_path_factory):
    """Each head's single-process run (saved: megalm.evaluate reads it) and its layouts, on one set of ranks."""
    from megalm.train import run as train_run
    from megalm.validation import validate
    gpt_run = run[0]
    root = tmp_path_factory.mktemp("classify_runs")
    overrides = {"bert_labels": _base(pretrained, sentiment), "gpt_labels": _gpt(gpt_run, sentiment, "labels"),
                 "bert_choice": _bert_choice(pretrained, choices), "gpt_choice": _gpt(gpt_run, choices, "choice")}
    cfgs = {}
    for head, base in overrides.items():
        cfgs[head] = cfg = load(*base, "checkpoint.save=true")
        validate(cfg, 1)
        train_run(cfg, root / head / "single", 1)
    jobs = [([*overrides[head], *layout], str(root / head / f"layout{i}"))
            for head, layouts in HEADS.items() for i, layout in enumerate(layouts)]
    run_layouts(2, jobs, timeout=300.0 * len(jobs))
    return root, cfgs


def test_first_step_is_the_pretrained_encoder_with_a_fresh_classifier(pretrained, runs):
    """Reference: a classifier model initialised by name, then every parameter it shares with the
    pretraining model copied over by hand, on the first global batch."""
    import torch.nn.functional as F
    from megalm.data import build_data, collate, load_tokenizer
    from megalm.data.samples.bert import BertSamples
    from megalm.generate import load_for_generation
    from megalm.models import build_model, init_weights
    root, cfgs = runs
    cfg = cfgs["bert_labels"]
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
    train, _ = _records(root / "bert_labels" / "single")
    assert train[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert "acc" in train[0] and train[-1]["loss"] < train[0]["loss"]


@pytest.mark.parametrize("head, index", [(h, i) for h, layouts in HEADS.items() for i in range(len(layouts))])
def test_fine_tuning_at_a_layout_matches_the_single_process(runs, head, index):
    root, _ = runs
    (single, single_val), (layout, layout_val) = _records(root / head / "single"), _records(root / head / f"layout{index}")
    assert len(single) == len(layout) == STEPS
    for key in ("loss", "acc"):
        np.testing.assert_allclose([r[key] for r in layout], [r[key] for r in single], rtol=1e-5)
    np.testing.assert_allclose(layout[0]["grad_norm"], single[0]["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in layout_val], [r["val_loss"] for r in single_val], rtol=1e-5)


def test_bad_classification_configs(pretrained, sentiment):
    from megalm.validation import validate
    base = _base(pretrained, sentiment)
    for extra, message in ((["model.num_labels=3"], r"data.task=sst2 has 2 label\(s\) .* model.num_labels=3"),
                           (["data=mock"], r"model.num_labels=2 fine-tunes on labelled examples: set data=classification"),
                           (["data.task=glue"], r"data.task='glue' is not one of jsonl, fasttext, mnli")):
        with pytest.raises(ConfigError, match=message):
            validate(load(*base, *extra), 1)
    for extra, message in ((["model.num_choices=2"], r"model.num_labels=2 and model.num_choices=2: .* keep one"),
                           (["model.num_labels=0", "model.num_choices=2"], r"data.task=sst2 has 2 label.*num_choices=0"),
                           (["model.num_labels=0", "model.num_choices=3", "data.task=race"],
                            r"data.task=race is multiple choice: set model.num_choices=4 \(got 3\)"),
                           (["model.num_labels=0", "model.num_choices=1"], r"model.num_choices=1 .* N >= 2"),
                           (["data=qa"], r"set data=qa and model.span_head=true together")):
        with pytest.raises(ConfigError, match=message):
            validate(load(*base, *extra), 1)
    with pytest.raises(ConfigError, match=r"data.source=qa trains BERT's span head"):
        validate(load(*[o for o in base if not o.startswith("model.num_labels")], "model=gpt_tiny", "data=qa"), 1)


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
    from megalm.data.tokenizers.specials import bert_specials
    from megalm.evaluate import evaluate
    from megalm.generate import load_for_generation
    root, _ = runs
    _, dev = sentiment
    got = evaluate(root / "bert_labels" / "single", "classify", dev)
    _, model, tok, _ = load_for_generation(root / "bert_labels" / "single")
    examples = read_examples([dev], "sst2", [], 2)
    right = 0
    with torch.no_grad():
        for e in examples:
            s = pair_sample(tok.encode(e.text), None, e.label, 32, bert_specials(tok))
            logits = model(*(torch.from_numpy(s[k])[None] for k in ("tokens", "token_types", "padding_mask")))
            right += int(int(logits.argmax(-1)) == e.label)
    assert got["examples"] == len(examples) == 24 and got["accuracy"] == right / len(examples)
    written = root / "bert_labels" / "single" / "eval" / "classify_dev.json"
    assert json.loads(written.read_text())["accuracy"] == got["accuracy"]
    with pytest.raises(ConfigError, match="scores a fine-tuned classifier"):
        evaluate(pretrained, "classify", dev)


def _first_batches(cfg, tokenizer, samples, n=4):
    """The trainer's first global batch of `cfg`'s run: micro-batches of 2 of the training split."""
    from megalm.data import build_data, collate
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=cfg.trainer.seed, tokenizer=tokenizer,
                      num_samples={"train": 8 * STEPS, "valid": 16}, samples=samples)
    return [collate([data.train[i] for i in (first, first + 1)]) for first in range(0, 2 * n, 2)]


def _fresh_head_model(cfg, pretrained_dir):
    """cfg's model initialised by name, every parameter the pretrained run has copied from it."""
    from megalm.generate import load_for_generation
    from megalm.models import build_model, init_weights
    _, old, tok, _ = load_for_generation(pretrained_dir)
    model = build_model(cfg.model)
    init_weights(model, cfg.model, cfg.trainer.seed)
    old_params = dict(old.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in old_params:
                p.copy_(old_params[name])
    return model.eval(), tok


def test_gpt_classifier_reads_the_last_real_token(runs, run):
    """Reference: each example run alone, unpadded, through the pretrained decoder and the fresh score
    head, its logits taken at its final position: the padded batch's loss must be the same."""
    import torch.nn.functional as F
    from megalm.data.samples.gpt import GPTSamples
    root, cfgs = runs
    cfg = cfgs["gpt_labels"]
    model, tok = _fresh_head_model(cfg, run[0])
    assert model.head is None and model.score is not None
    losses = []
    with torch.no_grad():
        for b in _first_batches(cfg, tok, GPTSamples(cfg.model)):
            rows = []
            for tokens, last in zip(b["tokens"], b["last"]):
                alone = tokens[: int(last) + 1]
                assert int(alone[-1]) == tok.eod and (tokens[int(last) + 1:] == tok.eod).all()
                rows.append(model(alone[None])[0, -1])
            losses.append(float(F.cross_entropy(torch.stack(rows), b["label"])))
    train, _ = _records(root / "gpt_labels" / "single")
    assert train[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)


def test_multiple_choice_scores_each_choice_as_its_own_sequence(runs, pretrained, choices):
    """Reference: a one-output BERT regressor with the choice model's weights (the same parameter
    names) scores [CLS] context [SEP] choice [SEP] of each choice, one at a time; the softmax over
    the two scores against the label."""
    import dataclasses
    import torch.nn.functional as F
    from megalm.data.samples.bert import BertSamples
    from megalm.data.tokenizers.specials import bert_specials
    from megalm.models import build_model
    root, cfgs = runs
    cfg = cfgs["bert_choice"]
    chooser, tok = _fresh_head_model(cfg, pretrained)
    model = build_model(dataclasses.replace(cfg.model, num_choices=0, num_labels=1)).eval()
    model.load_state_dict(chooser.state_dict())
    examples = read_examples([choices[0]], "choice", [], 0, 2)
    assert examples[0].choices is not None and len(examples) == 64
    batches = _first_batches(cfg, tok, BertSamples(cfg.model))
    assert batches[0]["tokens"].shape == (2, 2, cfg.model.seq_length)
    losses = []
    with torch.no_grad():
        for b in batches:
            scores = [[float(model(*(b[k][i, c][None] for k in ("tokens", "token_types", "padding_mask")))[0, 0])
                       for c in range(2)] for i in range(2)]
            losses.append(float(F.cross_entropy(torch.tensor(scores), b["label"])))
    train, _ = _records(root / "bert_choice" / "single")
    assert train[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    # each choice sequence is the context then that choice
    first = examples[0]
    sample = BertSamples(cfg.model).classification(tok, cfg.model.seq_length)(first)
    for c, text in enumerate(first.choices):
        want = pair_sample(tok.encode(first.text), tok.encode(text), first.label, cfg.model.seq_length,
                           bert_specials(tok))
        assert (sample["tokens"][c] == want["tokens"]).all() and (sample["token_types"][c] == want["token_types"]).all()


def test_evaluate_classify_scores_gpt_and_multiple_choice_runs(runs, choices, sentiment):
    """The classify task's accuracy equals the predictions counted one example at a time."""
    from megalm.evaluate import evaluate
    from megalm.generate import load_for_generation
    from megalm.models import family_of
    root, _ = runs
    for head, dev, task, n in (("gpt_choice", choices[1], "choice", 2), ("gpt_labels", sentiment[1], "sst2", 0),
                               ("bert_choice", choices[1], "choice", 2)):
        got = evaluate(root / head / "single", "classify", dev, batch_size=3)
        cfg, model, tok, _ = load_for_generation(root / head / "single")
        make = family_of(cfg.model.arch).samples(cfg.model).classification(tok, cfg.model.seq_length)
        examples = read_examples([dev], task, [], 0 if n else 2, n)
        right = 0
        with torch.no_grad():
            for e in examples:
                s = {k: torch.from_numpy(v)[None] for k, v in make(e).items()}
                out = model(*(s[k] for k in family_of(cfg.model.arch).inputs))
                pred = model.predictions(out, s) if hasattr(model, "predictions") else out
                right += int(int(pred.argmax(-1)) == e.label)
        assert got["examples"] == len(examples) and got["accuracy"] == right / len(examples), head
    with pytest.raises(ConfigError, match="fine-tuned scorer .* classify task"):
        evaluate(root / "gpt_labels" / "single", "perplexity", sentiment[1])
    from megalm.generate import check_generates  # nor does it sample its class scores as text
    from megalm.models.registry import load_run_config
    run = root / "gpt_labels" / "single"
    with pytest.raises(ConfigError, match=f"{run} is a fine-tuned scorer with no language-model head: megalm.generate "
                                          f"samples text .*; score it with `python -m megalm.evaluate {run} classify"):
        check_generates(load_run_config(run), run)


@pytest.mark.parametrize("name, text, message", [
    ("race.txt", '{"article": "a", "questions": ["q"], "options": [["a", "b", "c"]], "answers": ["A"]}',
     r"race.txt: question 0: RACE questions have 4 options"),
    ("race.txt", '{"article": "a", "questions": ["q"], "options": [["a", "b", "c", "d"]], "answers": ["E"]}',
     r"race.txt: question 0: answer 'E' is not one of A, B, C, D"),
    ("race.txt", '{"article": "a"', r"race.txt:\d+: not JSON"),
    ("c.jsonl", '{"context": "a", "choices": ["x", "y", "z"], "label": 0}', r"c.jsonl:1: 3 choices; model.num_choices=2"),
    ("c.jsonl", '{"context": "a", "choices": ["x", "y"], "label": 2}', r"c.jsonl:1: label 2 is not a choice's index"),
    ("c.jsonl", '{"context": "a", "label": 0}', r"c.jsonl:1: needs 'context'"),
])
def test_bad_choice_files_name_file_and_line(tmp_path, name, text, message):
    path = _write(tmp_path / name, [text])
    with pytest.raises(DataError, match=message):
        read_examples([path], "race" if name.endswith(".txt") else "choice", [], 0, 2 if "c." in name else 4)


def test_race_fills_the_blank_or_appends_the_option(tmp_path):
    d = tmp_path / "RACE" / "train" / "middle"
    d.mkdir(parents=True)
    (d / "1.txt").write_text(json.dumps({"article": "Tom has a cat.", "questions": ["Tom has a _ .", "What pet?"],
                                         "options": [["cat", "dog", "cow", "hen"], ["cat", "dog", "cow", "hen"]],
                                         "answers": ["A", "B"]}))
    got = read_examples([str(tmp_path / "RACE")], "race", [], 0, 4)
    assert got == [Example("Tom has a cat.", None, 0, ("Tom has a cat .", "Tom has a dog .", "Tom has a cow .",
                                                      "Tom has a hen .")),
                   Example("Tom has a cat.", None, 1, ("What pet? cat", "What pet? dog", "What pet? cow",
                                                      "What pet? hen"))]


def test_evaluate_classify_at_tp2_pp2_and_dp2(runs, choices, sentiment):
    """The classify task at --tp 2, --pp 2 and --dp 2 predicts as the single process does."""
    from megalm.evaluate import evaluate
    from megalm.evaluate.layout import on_ranks
    from eval_layouts import LAYOUTS, assert_same_numbers, evaluate_at_layouts
    root, _ = runs
    jobs = [(root / "gpt_labels" / "single", "classify", sentiment[1], {}),
            (root / "bert_choice" / "single", "classify", choices[1], {}),
            (root / "bert_labels" / "single", "classify", sentiment[1], {})]
    singles = [evaluate(r, t, d, write=False, **o) for r, t, d, o in jobs]
    for layout, results in zip(LAYOUTS, on_ranks(2, "cpu", evaluate_at_layouts, jobs)):
        for job, single, got in zip(jobs, singles, results):
            assert_same_numbers(single, got, (job[0].parent.name, layout))


def test_epochs_set_the_steps_from_the_examples(pretrained, sentiment, tmp_path, caplog):
    """trainer.epochs=2 over the training file's examples at global batch 8: ceil(2 x examples / 8) steps. The data
    is read twice (to count it, then to train), and what it holds is said once."""
    import logging
    from megalm.train import run
    from megalm.validation import validate
    examples = len(Path(sentiment[0]).read_text().splitlines()) - 1  # the header is not an example
    base = [o for o in _base(pretrained, sentiment) if not o.startswith("trainer.max_steps")]
    cfg = load(*base, "trainer.epochs=2", "trainer.max_steps=1")
    validate(cfg, 1)
    with caplog.at_level(logging.INFO):
        run(cfg, tmp_path / "run", 1)
    assert sum("classification (" in r.getMessage() for r in caplog.records) == 1
    assert sum("trainer.epochs=2 over" in r.getMessage() for r in caplog.records) == 1
    train, _ = _records(tmp_path / "run")
    assert len(train) == -(-2 * examples // 8) == 24
    assert "max_steps: 24" in (tmp_path / "run" / "config.yaml").read_text()
    for extra, message in ((["trainer.epochs=0"], r"trainer.epochs=0 must be at least 1"),
                           (["model.num_labels=0", "data=mock"], r"trainer.epochs=2 counts passes over fine-tuning")):
        with pytest.raises(ConfigError, match=message):
            validate(load(*base, "trainer.epochs=2", *extra), 1)
