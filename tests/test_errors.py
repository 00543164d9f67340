"""The error path as a user meets it: the command's exit code, and the first lines it prints.

The real command runs where the path crosses a process (the launcher and its ranks, a signal, a kill, a
traceback on request) and for one mistake of each stage (composition, validation); the others call the
same entry, run_hydra_app over train's Hydra app, in this process, which spares a torch import a case.

A megalm error is one line (or a short list) starting `megalm: <kind>:`, never a traceback or
Hydra's HYDRA_FULL_ERROR footer; a run that goes wrong stops with a non-zero exit; a rejected
resume leaves the run directory as it was.
"""

import json
import logging
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megalm.data.corpora.stdlib import stdlib_corpus
from megalm.data.formats.indexed_writer import IndexedDatasetWriter
from megalm.data.provenance import write_provenance
from megalm.data.tokenizers.sentencepiece import SentencePieceTokenizer, train_sentencepiece

QUICK = ["model=gpt_tiny", "logging.curves=false", "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.eval_steps=1",
         "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1", "cluster.peak_flops=1e12"]
MOCK = [*QUICK, "data=mock"]


def cli(*args, cwd, env=None, module="megalm.train", timeout=300):
    import os
    full_env = {k: v for k, v in os.environ.items() if k not in ("MEGALM_FULL_ERROR", "HYDRA_FULL_ERROR")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_megalm_error(r, kind: str, *expected: str, max_lines: int = 1):
    """Exit 1, stderr is `megalm: <kind>: ...` in at most `max_lines` lines, naming `expected`."""
    err = r.stderr.strip()
    assert r.returncode == 1, (r.returncode, err[-3000:])
    assert err.startswith(f"megalm: {kind}: "), err[-3000:]
    assert len(err.splitlines()) <= max_lines, err
    assert "Traceback" not in r.stdout + r.stderr and "HYDRA_FULL_ERROR" not in err, err
    for text in expected:
        assert text in err, (text, err)


def steps_of(run_dir: Path):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


# -- while composing the config ------------------------------------------------------------------

# Mistakes Hydra meets while composing, before any task runs: the same code path as the command line's
# (run_hydra_app over train's Hydra app), called in this process to spare a torch import per case; the
# command line itself is checked on one of them and on the mistakes validation finds.
COMPOSE_MISTAKES = [
    ("model=gpt_tny", ["model=gpt_tny is not a model preset", "did you mean gpt_tiny?", "gpt_125m, gpt_13b",
                       "gpt_cpu, gpt_tiny"]),  # no family schema (gpt_schema) among the presets
    ("data.tokenizer.type=null", ["data.tokenizer.type=null", "quote it"]),
    ("trainer.max_steps=abc", ["trainer.max_steps=abc", "Integer"]),
    # Each family's schema takes its own fields only.
    ("model.binary_head=false", ["unknown key model.binary_head", "GPTConfig has", "tie_embeddings"]),
    ("model=bert_tiny model.rope_theta=5e5", ["unknown key model.rope_theta", "BertConfig has", "norm_position"]),
    # A comma makes Hydra read several values: how to write the one value each field takes.
    ("data.split=98,2,0", ["data.split=98,2,0: Hydra reads a comma as several values",
                           "data.split is a string: quote the commas, 'data.split=\"98,2,0\"'"]),
    ("optimizer.betas=0.9,0.99", ["optimizer.betas is a list: write optimizer.betas=[0.9,0.99]"]),
    ("trainer.max_steps=null", ["trainer.max_steps=null: trainer.max_steps needs a value (int)"]),
    ("parallel=null", ["parallel=null: the parallel group needs a preset", "dp2, dp4"]),
]


def in_process(monkeypatch, capsys, *args) -> subprocess.CompletedProcess:
    """`python -m megalm.train args`, called in this process: its exit code (0 when the task returns),
    stdout and stderr."""
    from megalm.cli import run_hydra_app
    from megalm.train import hydra_main
    for var in ("MEGALM_FULL_ERROR", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["megalm.train", *args])
    capsys.readouterr()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        run_hydra_app(hydra_main)
        code = 0
    except SystemExit as stop:
        code = stop.code
    finally:
        # Hydra's job logging gave the root logger handlers on this test's captured streams and its run
        # directory: left behind, later tests' records would go to closed files.
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@pytest.mark.parametrize("override,expected", COMPOSE_MISTAKES)
def test_composition_mistakes_are_one_line(tmp_path, monkeypatch, capsys, override, expected):
    r = in_process(monkeypatch, capsys, *MOCK, *override.split(), f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "invalid config", *expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,expected", [
    ("trainer.max_stepz=3", ["unknown key trainer.max_stepz", "did you mean trainer.max_steps?", "max_steps"]),
    ("trainer.precision=fp64", ["trainer.precision='fp64' is not one of fp32, bf16, fp16, fp8"]),
    ("model=bert_tiny model.norm_position=middle", ["model.norm_position='middle' is not one of pre, post"]),
])
def test_config_mistakes_are_one_line(tmp_path, monkeypatch, capsys, override, expected):
    r = in_process(monkeypatch, capsys, *MOCK, *override.split(), f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "invalid config", *expected)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_run_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "taken").write_text("not a directory")
    r = in_process(monkeypatch, capsys, *MOCK, f"hydra.run.dir={tmp_path / 'taken'}")
    assert_megalm_error(r, "invalid config", "is a file, not a directory")


def test_run_dir_that_cannot_be_made(tmp_path, monkeypatch, capsys):
    r = in_process(monkeypatch, capsys, *MOCK, "hydra.run.dir=/proc/megalm-test/run")  # /proc takes no folders
    assert_megalm_error(r, "invalid config", "hydra.run.dir=/proc/megalm-test/run: cannot make the run directory "
                        "there: /proc:")


def test_vocabulary_too_small_fails_before_the_corpus_is_built(tmp_path):
    # The default corpus trains an 8192-piece tokenizer; gpt_tiny has 256 ids. Said at once:
    # no tokenizer trained, no corpus tokenized (the cache stays empty).
    r = cli(*QUICK, f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_megalm_error(r, "invalid config", "data.tokenizer.vocab_size=8192", "model.vocab_size=256")
    assert not (tmp_path / "cache").exists()


def test_full_traceback_on_request(tmp_path):
    r = cli(*MOCK, "trainer.device=cuda" if not torch.cuda.is_available() else "checkpoint.load=/nowhere",
            f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"MEGALM_FULL_ERROR": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr


# -- files, devices, checkpoints -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two real sentencepiece models of the same size, trained on different text."""
    corpus = stdlib_corpus(1.0)
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for name, (a, b) in {"a": (0, 20), "b": (20, 40)}.items():
        (root / name).mkdir()
        (root / name / "tokenizer.model").write_bytes(train_sentencepiece(corpus.subset(a, b).texts(), 500))
        out[name] = root / name / "tokenizer.model"
    assert SentencePieceTokenizer(out["a"]).identity != SentencePieceTokenizer(out["b"]).identity
    return out


@pytest.fixture(scope="module")
def corpus_a(tokenizers, tmp_path_factory):
    """An indexed corpus written by tokenizer a, with the record megalm keeps beside it."""
    tok = SentencePieceTokenizer(tokenizers["a"])
    prefix = tmp_path_factory.mktemp("corpus") / "docs"
    texts = list(stdlib_corpus(1.0).texts())
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for ids in tok.encode_batch(texts):
            writer.add_document(ids + [tok.eod])
    write_provenance(prefix, tok, documents=len(texts))
    return prefix


def indexed(prefix, tokenizer, tmp_path):
    return ["data=indexed", f"data.paths=[{prefix}]", f"data.tokenizer.model={tokenizer}", "model.vocab_size=512",
            "data.split='80,20,0'", f"data.cache_dir={tmp_path / 'cache'}"]


@pytest.fixture(scope="module")
def trained(corpus_a, tokenizers, tmp_path_factory):
    """A 2-step run on corpus a with tokenizer a: the run directory the resume tests try to damage."""
    base = tmp_path_factory.mktemp("trained")
    r = cli(*QUICK, *indexed(corpus_a, tokenizers["a"], base), "trainer.max_steps=2",
            f"hydra.run.dir={base / 'run'}", cwd=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base / "run"


def snapshot(run_dir: Path):
    """Every file of the run directory and its bytes, but the log, which records each attempt."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "train.log"}


def test_resume_with_another_tokenizer_is_refused_and_changes_nothing(monkeypatch, capsys, trained, corpus_a,
                                                                       tokenizers, tmp_path):
    before = snapshot(trained)
    assert {"config.yaml", "tokenizer.model", "metrics.jsonl", "checkpoints/latest"} <= set(before)
    r = in_process(monkeypatch, capsys, *QUICK, *indexed(corpus_a, tokenizers["b"], tmp_path), "trainer.max_steps=4",
                   f"hydra.run.dir={trained}")
    a, b = (SentencePieceTokenizer(tokenizers[k]).identity for k in "ab")
    assert_megalm_error(r, "checkpoint", "was trained with tokenizer", a, b, str(tokenizers["b"]))
    assert snapshot(trained) == before


def test_resume_with_another_model_is_refused_and_changes_nothing(monkeypatch, capsys, trained, corpus_a, tokenizers,
                                                                   tmp_path):
    before = snapshot(trained)
    r = in_process(monkeypatch, capsys, *QUICK, *indexed(corpus_a, tokenizers["a"], tmp_path), "trainer.max_steps=4",
                   "model.hidden_size=64", f"hydra.run.dir={trained}")
    assert_megalm_error(r, "checkpoint", "does not fit this model config",
                        "embed.tok.weight: stored (512, 32), expected (512, 64)", max_lines=40)
    assert snapshot(trained) == before
    assert not (tmp_path / "cache").exists()  # refused before any sample index was built
    g = cli(str(trained), "--prompt", "def ", "--max-new-tokens", "3", cwd=tmp_path, module="megalm.generate")
    assert g.returncode == 0, g.stderr[-3000:]  # the run directory still generates


def test_resuming_a_finished_run_says_there_is_nothing_to_do(monkeypatch, capsys, trained, corpus_a, tokenizers,
                                                              tmp_path):
    before = snapshot(trained)
    r = in_process(monkeypatch, capsys, *QUICK, *indexed(corpus_a, tokenizers["a"], tmp_path), "trainer.max_steps=1",
                   f"hydra.run.dir={trained}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing to train: checkpoint" in r.stdout + r.stderr and "trainer.max_steps=1" in r.stdout + r.stderr
    assert snapshot(trained) == before


def test_corpus_of_another_tokenizer_is_refused(monkeypatch, capsys, corpus_a, tokenizers, tmp_path):
    r = in_process(monkeypatch, capsys, *QUICK, *indexed(corpus_a, tokenizers["b"], tmp_path), "trainer.max_steps=1",
                   f"hydra.run.dir={tmp_path / 'run'}")
    a, b = (SentencePieceTokenizer(tokenizers[k]).identity for k in "ab")
    assert_megalm_error(r, "data", f"{corpus_a} was tokenized with {a}", b)
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("damage,kind,expected", [
    ("missing_bin", "not found", ["docs.bin does not exist"]),
    ("truncated_bin", "data", ["docs.bin", "bytes"]),
    ("bad_magic", "data", ["docs.idx: bad magic"]),
    ("missing_tokenizer", "not found", ["sentencepiece model", "does not exist"]),
])
def test_damaged_data_files_are_named(monkeypatch, capsys, corpus_a, tokenizers, tmp_path, damage, kind, expected):
    import shutil
    prefix = tmp_path / "docs"
    for ext in (".bin", ".idx", ".megalm.json"):
        shutil.copy(str(corpus_a) + ext, str(prefix) + ext)
    tokenizer = tokenizers["a"]
    if damage == "missing_bin":
        Path(str(prefix) + ".bin").unlink()
    elif damage == "truncated_bin":
        with open(str(prefix) + ".bin", "r+b") as f:
            f.truncate(100)
    elif damage == "bad_magic":
        with open(str(prefix) + ".idx", "r+b") as f:
            f.write(b"NOTMAGIC")
    else:
        tokenizer = tmp_path / "missing.model"
    r = in_process(monkeypatch, capsys, *QUICK, *indexed(prefix, tokenizer, tmp_path), "trainer.max_steps=1",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, kind, *expected)


@pytest.fixture(scope="module")
def mock_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("mock")
    r = cli(*MOCK, "trainer.max_steps=2", "checkpoint.interval=1", "checkpoint.keep_last=0",
            f"hydra.run.dir={base / 'run'}", cwd=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base / "run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_gpu(monkeypatch, capsys, tmp_path):
    r = in_process(monkeypatch, capsys, *MOCK, "trainer.device=cuda", f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "device", "trainer.device=cuda", "no CUDA device")


def test_a_checkpoint_folder_that_cannot_be_written_is_said_before_training(monkeypatch, capsys, tmp_path):
    r = in_process(monkeypatch, capsys, *MOCK, "trainer.max_steps=2", "checkpoint.dir=/proc/megalm-test/ckpt",
                   f"hydra.run.dir={tmp_path / 'run'}")  # /proc takes no folders
    assert_megalm_error(r, "checkpoint", "checkpoint.dir=/proc/megalm-test/ckpt: cannot write checkpoints into "
                        "/proc/megalm-test/ckpt:", "point checkpoint.dir at a folder you can write to")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or steps_of(tmp_path / "run") == []  # nothing trained


def test_a_checkpoint_of_another_model_family_names_both(monkeypatch, capsys, mock_run, tmp_path):
    bert = [a for a in MOCK if not a.startswith("model=")] + ["model=bert_tiny"]
    r = in_process(monkeypatch, capsys, *bert, f"checkpoint.load={mock_run}", "checkpoint.finetune=true",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "checkpoint", f"checkpoint {mock_run / 'checkpoints' / 'step_00000002'} holds a gpt model "
                        "(its config.yaml), and this run's model is bert (model=bert_tiny)")


def test_a_model_whose_state_outgrows_the_machine_is_refused_before_allocating(monkeypatch, capsys, tmp_path):
    from megalm.training import memory
    assert memory.free_host_memory() > 0  # this machine's /proc/meminfo is read
    # gpt_tiny's ~25k parameters x 16 bytes (fp32 weights, gradients, Adam's two moments) against 100 kB free.
    monkeypatch.setattr(memory, "free_host_memory", lambda: 100_000)
    allocated = []
    monkeypatch.setattr("megalm.parallel.materialize", lambda *a, **k: allocated.append(a))
    r = in_process(monkeypatch, capsys, *MOCK, f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "invalid config", "model=gpt_tiny: its weights, gradients and optimizer state alone take",
                        "x 16 bytes x 1 rank(s) on this machine), more than the 0.0 GB it has free")
    assert allocated == []


def test_curves_without_the_metrics_they_are_drawn_from_are_said_to_be_missing(monkeypatch, capsys, tmp_path):
    r = in_process(monkeypatch, capsys, *MOCK, "trainer.max_steps=1", "logging.jsonl=false", "logging.curves=true",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "logging.curves=true draws metrics.jsonl, which logging.jsonl=false leaves unwritten: no curves.png" in \
        r.stdout + r.stderr
    assert not (tmp_path / "run" / "curves.png").exists()


def test_a_folder_named_as_a_data_file_is_called_a_folder(tmp_path):
    from megalm.data.tasks.sft import sft_records
    from megalm.data.tasks.squad import read_squad
    from megalm.errors import DataError
    with pytest.raises(DataError, match=f"^{tmp_path} is a folder, not a file$"):
        read_squad(tmp_path)
    with pytest.raises(DataError, match=f"^{tmp_path / 'none.json'} does not exist$"):
        read_squad(tmp_path / "none.json")
    with pytest.raises(DataError, match=f"^data.paths: {tmp_path} is a folder, not a file$"):
        list(sft_records([str(tmp_path)]))


def test_a_data_file_that_is_not_utf8_names_its_line(tmp_path):
    """Latin-1 bytes (é as 0xE9) on line 2 of each reader's file: a DataError naming the file and line, not a
    UnicodeDecodeError's traceback. A byte-order mark and CRLF line ends still read."""
    from megalm.data.tasks.classification import read_examples
    from megalm.data.formats.jsonl import json_lines, parallel_lines
    from megalm.errors import DataError
    bad = "not UTF-8 text (invalid continuation byte at byte {at} of the line); re-encode it as UTF-8"
    files = {"a.jsonl": b'{"text": "fine", "label": 0}\r\n{"text": "caf\xe9 ok", "label": 1}\n',
             "a.ft": b"__label__pos fine\n__label__neg caf\xe9 au lait\n",
             "a.tsv": b"sentence\tlabel\nfine\t1\ncaf\xe9\t0\n", "p.en": b"one\ntwo\n", "p.fr": b"un\ndeux \xe9\n"}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    expect = lambda name, line, at: "^" + re.escape(f"{tmp_path / name}:{line}: " + bad.format(at=at)) + "$"  # noqa: E731
    with pytest.raises(DataError, match=expect("a.jsonl", 2, 13)):
        list(json_lines(tmp_path / "a.jsonl"))
    with pytest.raises(DataError, match=expect("a.ft", 2, 16)):
        read_examples([str(tmp_path / "a.ft")], "fasttext", ["neg", "pos"], 2)
    with pytest.raises(DataError, match=expect("a.tsv", 3, 3)):
        read_examples([str(tmp_path / "a.tsv")], "sst2", [], 2)
    with pytest.raises(DataError, match=expect("p.fr", 2, 5)):
        list(parallel_lines(tmp_path / "p.en", tmp_path / "p.fr"))
    # A byte-order mark (as Windows editors write one) and CRLF line ends read as plain UTF-8 lines.
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one", "label": 0}\r\n{"text": "two", "label": 1}\r\n')
    assert [r["text"] for _, r in json_lines(tmp_path / "b.jsonl")] == ["one", "two"]
    (tmp_path / "b.tsv").write_bytes(b"\xef\xbb\xbfsentence\tlabel\r\nfine\t1\r\n")
    assert read_examples([str(tmp_path / "b.tsv")], "sst2", [], 2)[0].text == "fine"
    from megalm.data.tasks.squad import read_squad
    squad = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": "a b", "qas": [
        {"id": "1", "question": "q", "answers": [{"text": "a", "answer_start": 0}], "is_impossible": False}]}]}]}
    (tmp_path / "b.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(squad).encode())
    assert [q.qid for q in read_squad(tmp_path / "b.json")] == ["1"]


def test_missing_and_damaged_checkpoints(monkeypatch, capsys, mock_run, tmp_path):
    r = in_process(monkeypatch, capsys, *MOCK, f"checkpoint.load={tmp_path / 'nowhere'}",
                   f"hydra.run.dir={tmp_path / 'a'}")
    assert_megalm_error(r, "not found", f"no checkpoint at {tmp_path / 'nowhere'}")
    import shutil
    damaged = tmp_path / "step_00000001"
    shutil.copytree(mock_run / "checkpoints" / "step_00000001", damaged)
    with open(damaged / ".metadata", "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff\xff")
    r = in_process(monkeypatch, capsys, *MOCK, f"checkpoint.load={damaged}", f"hydra.run.dir={tmp_path / 'b'}")
    assert_megalm_error(r, "checkpoint", f"checkpoint {damaged} failed verification", ".metadata: CRC-32")


def test_a_failing_rank_reports_like_a_single_process(tmp_path):
    r = cli(*MOCK, "parallel=dp2", f"checkpoint.load={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'a'}",
            cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 1, err[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, err[-3000:]
    assert err.splitlines()[-1].startswith(f"megalm: not found: no checkpoint at {tmp_path / 'nowhere'}"), err
    assert len([line for line in err.splitlines() if line.startswith("megalm:")]) == 1, err


# -- runs that go wrong --------------------------------------------------------------------------

def test_diverged_training_stops_and_keeps_the_last_good_checkpoint(monkeypatch, capsys, tmp_path):
    run_dir = tmp_path / "run"
    r = in_process(monkeypatch, capsys, *MOCK, "optimizer.lr=1e3", "trainer.max_steps=40", "checkpoint.interval=2",
                   "checkpoint.keep_last=0", f"hydra.run.dir={run_dir}")
    assert_megalm_error(r, "training stopped", "the gradient norm is", "it diverged", "Lower optimizer.lr")
    bad_step = int(r.stderr.split("step ", 1)[1].split(":", 1)[0])
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert int(latest.split("_")[1]) < bad_step and latest in r.stderr  # kept, and named
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved[-1] == latest  # nothing was saved after the divergence
    assert max(steps_of(run_dir)) < bad_step


def test_a_loss_already_non_finite_before_any_update_does_not_blame_the_learning_rate(monkeypatch, capsys, tmp_path):
    # Weights drawn with std 1e30 overflow fp32 in the first forward: no learning rate is at fault.
    r = in_process(monkeypatch, capsys, *MOCK, "model.init_std=1e30", "trainer.max_steps=4",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "training stopped", "step 1: the loss is nan at this run's first step, before any update",
                        "which no learning rate changes", "no checkpoint was written")
    assert "Lower optimizer.lr" not in r.stderr


def test_fp16_that_keeps_overflowing_stops(monkeypatch, capsys, tmp_path):
    r = in_process(monkeypatch, capsys, *MOCK, "optimizer.lr=1e3", "trainer.max_steps=200", "trainer.precision=fp16",
                   "trainer.max_consecutive_skips=8", f"hydra.run.dir={tmp_path / 'run'}")
    assert_megalm_error(r, "training stopped", "8 fp16 steps in a row overflowed", "trainer.max_consecutive_skips=8")


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_to_a_multi_rank_run_saves_and_exits_0(tmp_path, signame):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megalm.train", *MOCK, "parallel=dp2", "trainer.max_steps=100000",
                             "trainer.eval_steps=0", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signame))  # to the launcher only, as `kill PID` or a scheduler does
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    # The whole stderr on failure (an ignored exception of torch's keep-alive timer once showed here: see
    # megalm.launch._stop_rendezvous_heartbeats).
    assert "Traceback" not in out + err and "a stop signal arrived; saved and stopping" in out + err, err[-6000:]
    saved = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert saved >= 3 and max(steps_of(run_dir)) == saved


def test_a_save_that_cannot_write_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    # A file-size limit makes the second save's writes fail as a full disk does (EFBIG, not ENOSPC:
    # the same failed write(), and no root needed to provoke it).
    hook = textwrap.dedent("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing the process
        from megalm.training.checkpoint import Checkpointer
        save = Checkpointer.save
        def limited(self, step, *args, **kwargs):
            if step == 4:
                resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
            return save(self, step, *args, **kwargs)
        Checkpointer.save = limited
        from megalm.train import main
        sys.argv = ["megalm.train", *sys.argv[1:]]
        main()
    """)
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", hook, *MOCK, "trainer.max_steps=6", "checkpoint.interval=2",
                        "trainer.eval_steps=0", f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    ckpt = run_dir / "checkpoints"
    assert_megalm_error(r, "checkpoint", f"could not write the checkpoint into {ckpt / '.step_00000004.tmp'}",
                        "File too large", f"the previous checkpoint ({ckpt / 'step_00000002'}) is kept")
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"]  # the partial folder is gone
