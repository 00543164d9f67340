"""megalm.report: a Hydra sweep's summary and curves, from real multirun jobs, and the report's own errors."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys

import pytest

QUICK = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
         "trainer.max_steps=6", "trainer.eval_interval=3", "trainer.eval_steps=1", "trainer.log_interval=1",
         "trainer.progress_bar=false", "trainer.num_threads=1", "cluster.peak_flops=1e12"]
PNG = b"\x89PNG\r\n\x1a\n"


def _records(run_dir, key):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r[key]) for r in map(json.loads, lines) if key in r]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Three jobs of one multirun, in one process as Hydra's basic launcher runs them: two learning rates
    that train, and a third the config refuses, which ends the sweep with megalm's error."""
    root = tmp_path_factory.mktemp("sweep")
    out = subprocess.run([sys.executable, "-m", "megalm.train", "-m", *QUICK, "optimizer.lr=0.001,0.003,-1",
                          f"hydra.sweep.dir={root / 'sweep'}"], cwd=root, capture_output=True, text=True, timeout=600)
    return root / "sweep", out


def test_a_sweep_summarises_its_jobs_failed_ones_included(sweep):
    sweep_dir, out = sweep
    assert out.returncode == 1 and "optimizer.lr=-1" in out.stderr, out.stderr[-2000:]
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [r["overrides"].split()[-1] for r in rows] == ["optimizer.lr=0.001", "optimizer.lr=0.003", "optimizer.lr=-1"]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert "optimizer.lr=-1" in rows[2]["error"] and rows[2]["val_loss"] == ""
    from megalm.models import build_model
    from megalm.plan import compose
    model = build_model(compose(QUICK)[0].model)  # a real CPU model: its parameters, counted independently
    for row in rows[:2]:
        run_dir = sweep_dir / row["job"]
        assert float(row["val_loss"]) == pytest.approx(_records(run_dir, "val_loss")[-1][1], rel=1e-3)
        speeds = [v for _, v in _records(run_dir, "tokens_per_s")]  # the median of the logged ones
        assert len(speeds) > 2 and float(row["tokens_per_s"]) == pytest.approx(statistics.median(speeds), rel=1e-3)
        assert int(row["params"]) == sum(p.numel() for p in model.parameters())
    assert rows[0]["val_loss"] != rows[1]["val_loss"]  # two learning rates, two runs
    md = (sweep_dir / "summary.md").read_text().splitlines()
    assert len(md) == 2 + 3 and md[0].startswith("| job | overrides | status | val_loss")


def test_each_run_draws_its_curves_when_it_ends(sweep):
    sweep_dir, _ = sweep
    for job in ("0", "1"):
        assert (sweep_dir / job / "curves.png").read_bytes()[:8] == PNG
    assert not (sweep_dir / "2" / "curves.png").exists()  # refused before it started


def test_the_report_draws_every_run_of_a_sweep(sweep):
    """`python -m megalm.report SWEEP_DIR` writes report.png there; the figure it draws has one line a run in
    each panel, holding that run's metrics.jsonl values, labelled by the override that sets it apart."""
    sweep_dir, _ = sweep
    out = subprocess.run([sys.executable, "-m", "megalm.report", str(sweep_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 run(s) drawn" in out.stdout and (sweep_dir / "report.png").read_bytes()[:8] == PNG
    from megalm.report import draw, find_runs
    runs = find_runs([sweep_dir])
    assert [r.name for r in runs] == ["0", "1"]
    fig = draw(runs)
    panels = fig.axes[:4]
    assert [ax.get_title() for ax in panels] == ["loss", "validation perplexity", "learning rate", "throughput"]
    assert [ax.get_ylabel() for ax in panels] == ["loss (nats a token)", "perplexity (e^loss)", "learning rate",
                                                  "tokens/s"]
    assert fig.get_suptitle().startswith("2 runs of gpt_tiny: ") and "optimizer.lr" not in fig.get_suptitle()
    label = {"0": "optimizer.lr=0.001", "1": "optimizer.lr=0.003"}  # the override that sets each apart
    for ax, keys in zip(panels, (["loss", "val_loss"], ["val_ppl"], ["lr"], ["tokens_per_s"])):
        lines = ax.get_lines()
        assert sorted((line.get_gid(), line.get_label()) for line in lines) == \
            sorted((k, label[r.name]) for k in keys for r in runs)  # training and validation loss in one panel
        for line in lines:
            run = next(r for r in runs if label[r.name] == line.get_label())
            steps, values = zip(*_records(run, line.get_gid()))
            assert list(line.get_xdata()) == list(steps) and list(line.get_ydata()) == pytest.approx(values)
            assert line.get_linestyle() == ("--" if line.get_gid() == "val_loss" else "-")


def test_a_fine_tunes_curves_draw_its_task_metric_and_title_it(tmp_path):
    """A fine-tune's validation accuracy gets the second panel (its perplexity would mean nothing there); the title
    names the model and the run's layout, precision, batch, learning rate and steps."""
    from megalm.report import draw
    run = tmp_path / "ft"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  name: gpt_125m\n  seq_length: 128\nparallel:\n  tp: 2\n  pp: 1\n"
                                     "  dp: 1\n  cp: 1\ntrainer:\n  precision: bf16\n  global_batch_size: 16\n"
                                     "  max_steps: 4\noptimizer:\n  lr: 2.0e-05\n")
    records = [{"step": k, "loss": 1.0 / k, "lr": 2e-5, "tokens_per_s": 100.0} for k in range(1, 5)]
    records += [{"step": k, "val_loss": 0.9 / k, "val_acc": 0.5 + k / 10} for k in (2, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = draw([run])
    assert fig.get_suptitle() == "gpt_125m: tp2, bf16, batch 16 x 128 tokens, lr 2e-05, 4 steps"
    metric = fig.axes[1]
    assert metric.get_title() == "validation accuracy" and metric.get_ylabel() == "accuracy (fraction right)"
    (line,) = metric.get_lines()
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == pytest.approx([0.7, 0.9])
    assert {line.get_gid() for line in fig.axes[0].get_lines()} == {"loss", "val_loss"}
    fig.savefig(tmp_path / "ft.png")


@pytest.mark.parametrize("args,says", [
    (["{tmp}"], "no metrics.jsonl in or below"),
    (["{tmp}/missing"], "is not a directory"),
    (["{tmp}", "{tmp}"], "--output FILE.png"),
    (["{tmp}", "--output", "{tmp}/report.pdf"], "ending in .png"),
])
def test_report_errors_name_the_input(tmp_path, args, says):
    out = subprocess.run([sys.executable, "-m", "megalm.report", *(a.format(tmp=tmp_path) for a in args)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_plain_run_draws_its_curves_unless_told_not_to(tmp_path):
    """Outside a sweep too: the run's rank 0 draws curves.png as the run ends (and a plain run from the
    command line writes no job.json); logging.curves=false skips it (in-process: the run's own code)."""
    from configs import load
    from megalm.train import run
    out = subprocess.run([sys.executable, "-m", "megalm.train", *QUICK, "trainer.max_steps=2",
                          f"hydra.run.dir={tmp_path / 'cli'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "cli" / "curves.png").read_bytes()[:8] == PNG and not (tmp_path / "cli" / "job.json").exists()
    for curves in (True, False):
        run(load(*QUICK, "trainer.max_steps=2", f"logging.curves={str(curves).lower()}"), tmp_path / str(curves), 1)
        assert (tmp_path / str(curves) / "curves.png").exists() == curves


def test_an_optuna_study_minimises_the_validation_loss_and_outlives_a_failed_trial(tmp_path):
    """`hydra/sweeper=optuna` (hydra-optuna-sweeper): three trials over three learning rates, one of which
    the config refuses. The failed trial is recorded (its summary row, optuna's warning) and the
    study goes on; its best value is the lowest validation loss of the trials that ran, and its best
    parameter that trial's learning rate."""
    import yaml
    sweep_dir = tmp_path / "study"
    out = subprocess.run([sys.executable, "-m", "megalm.train", "-m", *QUICK, "hydra/sweeper=optuna",
                          # optuna 2.10's RandomSampler at seed 2 draws each of the three choices once
                          "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=2",
                          "hydra.sweeper.n_trials=3", "hydra.sweeper.direction=minimize",
                          "hydra.sweeper.max_failure_rate=1.0", "optimizer.lr=choice(0.001,0.003,-1)",
                          f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed experiment" in out.stderr + out.stdout and "optimizer.lr=-1" in out.stderr + out.stdout
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["status"] for r in rows) == ["failed", "ok", "ok"]
    ok = [r for r in rows if r["status"] == "ok"]
    lr = lambda row: next(o for o in row["overrides"].split() if o.startswith("optimizer.lr="))  # noqa: E731
    losses = {lr(r): _records(sweep_dir / r["job"], "val_loss")[-1][1] for r in ok}
    assert len(losses) == 2 and lr(next(r for r in rows if r["status"] == "failed")) == "optimizer.lr=-1"
    result = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = min(losses, key=losses.get)
    assert result["best_value"] == pytest.approx(losses[best], rel=1e-6)
    assert f"optimizer.lr={result['best_params']['optimizer.lr']}" == best


@pytest.mark.parametrize("raised,status", [(KeyboardInterrupt(), "stopped"), (RuntimeError("boom"), "failed")])
def test_a_job_stopped_by_ctrl_c_is_not_a_failure(tmp_path, monkeypatch, raised, status):
    """A sweep job's record says what ended it: Ctrl-C is `stopped`, with no error; an exception is `failed`,
    with its type and message. Either way it reaches the sweeper."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    import megalm.train as train
    from megalm.config import conf_dir
    from omegaconf import open_dict
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["model=gpt_tiny", "data=mock"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.sweep.dir = str(tmp_path)
        cfg.hydra.runtime.output_dir = str(tmp_path / "0")
        cfg.hydra.overrides.task = ["optimizer.lr=0.1"]
    HydraConfig.instance().set_config(cfg)

    def run(dcfg):
        raise raised
    monkeypatch.setattr(train, "_run", run)
    with pytest.raises(type(raised)):
        train._task(cfg)
    job = json.loads((tmp_path / "0" / "job.json").read_text())
    assert job["status"] == status and job["overrides"] == ["optimizer.lr=0.1"]
    assert job["error"] == (None if status == "stopped" else "RuntimeError: boom")
    assert (tmp_path / "summary.csv").read_text().splitlines()[1].startswith(f"0,optimizer.lr=0.1,{status}")


def test_an_output_that_cannot_be_written_is_named_before_drawing(tmp_path, capsys, monkeypatch):
    """--output in a folder that cannot be made or written is one line naming it, said before the figure is drawn
    (not PIL's traceback after); a folder that is only missing is made, as before."""
    import megalm.report as report
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    report.main([str(run), "--output", str(tmp_path / "missing" / "x.png")])
    assert (tmp_path / "missing" / "x.png").read_bytes()[:8] == PNG
    (tmp_path / "file").write_text("")
    (tmp_path / "d.png").mkdir()
    monkeypatch.setattr(report, "draw", lambda *a, **k: pytest.fail("drew before checking --output"))
    for output in (tmp_path / "file" / "x.png", tmp_path / "file" / "sub" / "x.png", tmp_path / "d.png"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            report.main([str(run), "--output", str(output)])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 1 and err.startswith(f"megalm.report: invalid config: --output={output}"), err
