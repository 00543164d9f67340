"""BERT fine-tuned for extractive QA (data=qa, model.span_head): SQuAD files read into windows
whose targets are the answer's tokens, a start from the pretrained BERT run with a fresh span
head, the same losses at tp2+sp, pp2 and dp2 ZeRO-1 as in one process, and megalm.evaluate's
squad task scoring the run with the official definitions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megalm.data.tasks.squad import read_squad
from megalm.errors import ConfigError
from configs import load
from layouts import run_layouts

STEPS = 4
NAMES = ["Anna", "Boris", "Carla", "David", "Elena", "Felix", "Greta", "Hugo"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Quito", "Bern"]


def _squad(path: Path, n: int, seed: int, impossible: bool) -> str:
    """A SQuAD file of made-up biographies: where / when someone was born, where someone moved;
    with `impossible`, also questions about a person the context does not name (v2.0)."""
    rng = np.random.default_rng(seed)
    paragraphs = []
    for p in range(n):
        a, b, c = rng.choice(NAMES, 3, replace=False)
        born, moved = rng.choice(CITIES, 2, replace=False)
        year = str(int(rng.integers(1900, 2000)))
        context = f"{a} was born in {born} in {year}. Later {b} moved to {moved} with friends."
        qas = [{"id": f"{p}w", "question": f"Where was {a} born?", "answers": [{"text": born,
                "answer_start": context.index(born)}]},
               {"id": f"{p}y", "question": f"When was {a} born?", "answers": [{"text": year,
                "answer_start": context.index(year)}]},
               {"id": f"{p}m", "question": f"Where did {b} move?", "answers": [{"text": f"to {moved}",
                "answer_start": context.index(f"to {moved}")}, {"text": moved, "answer_start": context.index(moved)}]}]
        if impossible:
            for q in qas:
                q["is_impossible"] = False
            qas.append({"id": f"{p}x", "question": f"Where was {c} born?", "answers": [], "is_impossible": True})
        paragraphs.append({"context": context, "qas": qas})
    path.write_text(json.dumps({"version": "v2.0" if impossible else "1.1",
                                "data": [{"title": "people", "paragraphs": paragraphs}]}))
    return str(path)


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("squad")
    return (_squad(root / "train.json", 24, 0, False), _squad(root / "dev.json", 6, 1, False),
            _squad(root / "dev2.json", 6, 2, True))


def _base(run_dir, files):
    train, dev, _ = files
    return ["model=bert_tiny", "model.vocab_size=1024", "model.span_head=true", "data=qa", f"data.paths=[{train}]",
            f"data.valid_paths=[{dev}]", "data.doc_stride=8", "data.max_query_length=12",
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
def runs(bert_run, squad_files, tmp_path_factory):
    from megalm.train import run
    from megalm.validation import validate
    root = tmp_path_factory.mktemp("qa_runs")
    cfg = load(*_base(bert_run, squad_files), "checkpoint.save=true")
    validate(cfg, 1)
    run(cfg, root / "single", 1)
    jobs = [([*_base(bert_run, squad_files), *layout], str(root / f"layout{i}")) for i, layout in enumerate(LAYOUTS)]
    run_layouts(2, jobs, timeout=300.0 * len(jobs))
    return root, cfg


def test_windows_target_the_answer_tokens(runs, bert_run, squad_files):
    """Every window's targets decode to the question's first answer (an exact match as SQuAD scores
    it), or are [CLS] when the window does not hold it; a long context is read in several windows, and some hold the answer."""
    from megalm.data.samples.bert import BertSamples
    from megalm.data import load_tokenizer
    from megalm.evaluate.squad import normalize_answer
    _, cfg = runs
    tok = load_tokenizer(bert_run)
    make = BertSamples(cfg.model).qa(tok, cfg.model.seq_length, cfg.data.doc_stride, cfg.data.max_query_length)
    counts = []
    for q in read_squad(squad_files[0]):
        windows = make(q)
        counts.append(len(windows))
        found = 0
        for w in windows:
            s = w.sample
            start, end = int(s["start_positions"]), int(s["end_positions"])
            if start == end == 0:
                continue
            found += 1
            # the answer's tokens (a piece may carry a stop after it: "1992." is one piece here)
            assert normalize_answer(tok.decode(s["tokens"][start:end + 1].tolist())) == normalize_answer(q.answers[0])
            assert s["token_types"][start] == 1 and s["padding_mask"][end] == 1
        assert found >= 1, q
    assert max(counts) > 1


def test_first_step_is_the_pretrained_encoder_with_a_fresh_span_head(runs, bert_run):
    """Reference: the mean of the start and end cross-entropies, each over the sequence, written out
    with log_softmax, on the first global batch of the pretrained encoder and a fresh head."""
    from megalm.data import build_data, collate, load_tokenizer
    from megalm.data.samples.bert import BertSamples
    from megalm.generate import load_for_generation
    from megalm.models import build_model, init_weights
    root, cfg = runs
    _, old, _, _ = load_for_generation(bert_run)
    model = build_model(cfg.model)
    init_weights(model, cfg.model, cfg.trainer.seed)
    old_params = dict(old.named_parameters())
    assert model.lm_head is None and model.pooler is None and "qa_head.weight" not in old_params
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in old_params:
                p.copy_(old_params[name])
    model.eval()
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=cfg.trainer.seed,
                      tokenizer=load_tokenizer(bert_run), num_samples={"train": 8 * STEPS, "valid": 16},
                      samples=BertSamples(cfg.model))
    losses = []
    with torch.no_grad():
        for first in range(0, 8, 2):
            b = collate([data.train[i] for i in (first, first + 1)])
            logits = model(b["tokens"], b["token_types"], b["padding_mask"]).double()
            nll = 0.0
            for i in range(2):
                for k, key in enumerate(("start_positions", "end_positions")):
                    nll -= float(torch.log_softmax(logits[i, :, k], 0)[int(b[key][i])]) / 4
            losses.append(nll)
    train, _ = _records(root / "single")
    assert train[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert {"start_acc", "end_acc"} <= set(train[0]) and train[-1]["loss"] < train[0]["loss"]


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_span_head_at_a_layout_matches_the_single_process(runs, index):
    root, _ = runs
    (single, single_val), (layout, layout_val) = _records(root / "single"), _records(root / f"layout{index}")
    assert len(single) == len(layout) == STEPS
    for key in ("loss", "start_acc", "end_acc"):
        np.testing.assert_allclose([r[key] for r in layout], [r[key] for r in single], rtol=1e-5)
    np.testing.assert_allclose(layout[0]["grad_norm"], single[0]["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in layout_val], [r["val_loss"] for r in single_val], rtol=1e-5)


@pytest.mark.parametrize("index", [1, 2])
def test_evaluate_squad_scores_the_answers_it_writes(runs, squad_files, index):
    """The reported EM / F1 are the official definitions over the predictions file; each answer is
    whole words of its context (or nothing, only where v2.0 allows it)."""
    from megalm.evaluate import evaluate
    from megalm.evaluate.squad import exact_match, f1, gold_answers
    root, _ = runs
    path = squad_files[index]
    got = evaluate(root / "single", "squad", path, batch_size=5)
    questions = read_squad(path)
    predictions = json.loads((root / "single" / "eval" / f"squad_{Path(path).stem}_predictions.json").read_text())
    assert set(predictions) == {q.qid for q in questions}
    for q in questions:
        answer = predictions[q.qid]
        assert answer == "" or f" {answer} " in f" {' '.join(q.context.split())} "
        assert answer != "" or index == 2 or not q.context.split()
    em = [exact_match(predictions[q.qid], gold_answers(q)) for q in questions]
    f = [f1(predictions[q.qid], gold_answers(q)) for q in questions]
    assert got["exact_match"] == pytest.approx(100 * np.mean(em)) and got["f1"] == pytest.approx(100 * np.mean(f))
    assert got["questions"] == len(questions) and got["version"] == ("2.0" if index == 2 else "1.1")
    assert ("no_answer_f1" in got) == (index == 2)


def test_bad_qa_configs(bert_run, squad_files):
    from megalm.evaluate import evaluate
    from megalm.validation import validate
    base = _base(bert_run, squad_files)
    for extra, message in ((["model.span_head=false"], r"set data=qa and model.span_head=true together"),
                           (["model.num_labels=2"], r"model.num_labels=2 and model.span_head=true: .* keep one"),
                           (["data.max_query_length=40"], r"data.max_query_length=40 .* model.seq_length=32")):
        with pytest.raises(ConfigError, match=message):
            validate(load(*base, *extra), 1)
    with pytest.raises(ConfigError, match="scores an extractive-QA run"):
        evaluate(bert_run, "squad", squad_files[1])
    from megalm.generate import check_generates
    from megalm.models.registry import load_run_config
    with pytest.raises(ConfigError, match=rf"{bert_run} is an encoder \(model.arch=bert\) with no decoder to sample"):
        check_generates(load_run_config(bert_run), bert_run)


def test_a_qa_run_is_pointed_at_the_squad_task(runs, squad_files):
    from megalm.evaluate import evaluate
    from megalm.generate import check_generates
    from megalm.models.registry import load_run_config
    root, _ = runs
    with pytest.raises(ConfigError, match="fine-tuned scorer .* score it with the squad task"):
        evaluate(root / "single", "perplexity", squad_files[1])
    with pytest.raises(ConfigError, match=f"`python -m megalm.evaluate {root / 'single'} squad --data FILE`"):
        check_generates(load_run_config(root / "single"), root / "single")


def test_fine_tuned_runs_do_not_export_as_language_models(runs, tmp_path):
    from megalm.convert import export_to_hf
    root, _ = runs
    with pytest.raises(ConfigError, match="fine-tuned classifier, multiple-choice or QA run"):
        export_to_hf(root / "single", tmp_path / "hf")


def test_evaluate_squad_at_tp2_pp2_and_dp2(runs, squad_files):
    from megalm.evaluate import evaluate
    from megalm.evaluate.layout import on_ranks
    from eval_layouts import LAYOUTS, assert_same_numbers, evaluate_at_layouts
    root, _ = runs
    jobs = [(root / "single", "squad", squad_files[index], {}) for index in (1, 2)]
    singles = [evaluate(r, t, d, write=False, **o) for r, t, d, o in jobs]
    for layout, results in zip(LAYOUTS, on_ranks(2, "cpu", evaluate_at_layouts, jobs)):
        for single, got in zip(singles, results):
            assert_same_numbers(single, got, layout)
            assert got["questions"] == single["questions"] and got["windows"] == single["windows"]
