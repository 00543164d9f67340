"""`python -m megalm.generate`: user mistakes are one line on stderr and exit code 1, never a
traceback; the cap that the model's context puts on generation is said up front.

The CLI runs as a subprocess on one tiny run (null tokenizer over 256 ids, model.seq_length=32),
trained once for the whole file; the other error paths call the same `main` in this process.
"""

import argparse
import shutil
import subprocess
import sys

import pytest

from megalm.errors import ConfigError, MissingFileError
from megalm.generate import check_options, generate_ids, main
from megalm.models import build_model, init_weights

SEQ, VOCAB = 32, 256  # gpt_tiny's


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen") / "run"
    r = subprocess.run([sys.executable, "-m", "megalm.train", "model=gpt_tiny", "data=mock", "trainer.max_steps=2",
                        "trainer.eval_steps=0", "trainer.num_threads=1", f"hydra.run.dir={d}"],
                       cwd=d.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def generate(*args):
    return subprocess.run([sys.executable, "-m", "megalm.generate", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def first_line(r):
    return r.stderr.splitlines()[0] if r.stderr else ""


def generate_here(capsys, *args):
    """`main` as the command line runs it, in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(list(map(str, args)))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("option,message", [
    (["--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature=-1 must be >= 0 (0 = greedy)"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
])
def test_an_option_out_of_range_names_its_range(run_dir, capsys, option, message):
    r = generate_here(capsys, run_dir, *option)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert first_line(r) == f"megalm.generate: invalid config: {message}"


@pytest.mark.parametrize("name,value,message", [
    ("top_p", 0.0, "--top-p=0 must be in (0, 1]"),
    ("temperature", float("nan"), "--temperature=nan must be >= 0"),  # NaN fails every comparison
    ("top_k", -1, "--top-k=-1 must be >= 0"),
    ("num_samples", 0, "--num-samples=0 must be >= 1"),
])
def test_every_option_is_checked(name, value, message):
    args = dict(max_new_tokens=5, temperature=0.8, top_k=50, top_p=0.95, num_samples=1)
    check_options(argparse.Namespace(**args))  # the defaults pass
    with pytest.raises(ConfigError) as e:
        check_options(argparse.Namespace(**dict(args, **{name: value})))
    assert str(e.value).startswith(message)


def test_a_prompt_id_outside_the_vocabulary_is_named_with_the_vocabulary_size(run_dir, capsys):
    r = generate_here(capsys, run_dir, "--prompt", "1 2 99999")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == ""
    assert first_line(r) == (f"megalm.generate: invalid config: --prompt has token id 99999, outside the "
                             f"vocabulary of {VOCAB} ids (0..{VOCAB - 1})")


def test_the_context_cap_is_said_up_front_and_honoured(run_dir, capsys):
    r = generate(run_dir, "--prompt", "1 2 3", "--max-new-tokens", "100", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert lines[0] == f"# gpt_tiny from {run_dir} (step 2)"
    room = SEQ - 4  # the end-of-document token, then the prompt's 3
    assert lines[1] == (f"# generating at most {room} tokens, not 100: prompt 4 (the end-of-document token + 3 of "
                        f"--prompt) + --max-new-tokens 100 > model.seq_length={SEQ}")
    words = r.stdout.split()
    assert words[:3] == ["1", "2", "3"] and 3 < len(words) <= 3 + room
    main([str(run_dir), "--prompt", "1 2 3", "--max-new-tokens", "5", "--temperature", "0"])  # in process: faster
    short = capsys.readouterr()
    assert len(short.err.splitlines()) == 1  # within the context: no note
    assert short.out.split() == words[:len(short.out.split())]  # greedy: the same first tokens


def test_a_prompt_that_fills_the_context_is_an_error(run_dir, capsys):
    r = generate_here(capsys, run_dir, "--prompt", " ".join(map(str, range(1, SEQ))))  # 31 ids + the eod = 32
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert first_line(r) == (f"megalm.generate: invalid config: --prompt is {SEQ} tokens (with the end-of-document "
                             f"token put before it) and model.seq_length={SEQ} leaves no room to generate: allowed: "
                             f"at most {SEQ - 1} tokens in all")


def test_missing_run_dir_config_or_checkpoint_is_one_line(run_dir, tmp_path, capsys, monkeypatch):
    r = generate(tmp_path / "nowhere")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert first_line(r).startswith(f"megalm.generate: not found: {tmp_path / 'nowhere'} does not exist")
    (tmp_path / "empty").mkdir()
    r = generate_here(capsys, tmp_path / "empty")  # in process from here on: the same main, without a new interpreter
    assert r.returncode == 1
    assert r.stderr.startswith(
        f"megalm.generate: not found: {tmp_path / 'empty' / 'config.yaml'} does not exist")
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    for name in ("config.yaml", "tokenizer.json"):
        shutil.copy(run_dir / name, no_ckpt / name)
    r = generate_here(capsys, no_ckpt)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert first_line(r).startswith(
        f"megalm.generate: not found: no complete checkpoint under {no_ckpt / 'checkpoints'}")
    # MEGALM_FULL_ERROR=1 lets the exception itself through, for its traceback.
    monkeypatch.setenv("MEGALM_FULL_ERROR", "1")
    with pytest.raises(MissingFileError, match="no complete checkpoint"):
        main([str(no_ckpt)])


def test_generate_ids_refuses_what_the_model_cannot_take(tiny_model_cfg):
    model = build_model(tiny_model_cfg)
    init_weights(model, tiny_model_cfg, 0)
    with pytest.raises(ConfigError, match=r"token id 100, outside the vocabulary of 100 ids \(0..99\)"):
        list(generate_ids(model, [1, 100], max_new_tokens=3))
    with pytest.raises(ConfigError, match=r"16 tokens and model.seq_length=16 leaves no room"):
        list(generate_ids(model, list(range(16)), max_new_tokens=3))
    assert len(list(generate_ids(model, list(range(15)), max_new_tokens=3, temperature=0.0))) == 1
