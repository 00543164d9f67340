"""The TensorBoard sink writes real event files whose scalars (values and steps) are what was logged.

The events are read back with TensorBoard's own EventAccumulator. TensorBoard stores scalars as
float32, so values are compared after the same rounding (exactly, as float32).
"""

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalm.training.metrics import TensorBoardSink

from configs import load


def _scalars(folder):
    """{tag: [(step, value), ...]} of every event file under `folder`."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0 = keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(x):
    return float(np.float32(x))


def test_sink_writes_numbers_under_their_step_and_skips_the_rest(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write({"step": 1, "loss": 5.25, "lr": 1e-3, "skipped": 0, "note": "text", "per_rank": [1.0, 2.0]})
    sink.write({"step": 2, "loss": 4.125, "lr": 2e-3, "skipped": 1})
    sink.write({"step": 2, "val_loss": 4.5, "val_ppl": 90.0})
    sink.close()
    got = _scalars(tmp_path / "tensorboard")
    assert got == {"loss": [(1, 5.25), (2, 4.125)], "lr": [(1, _f32(1e-3)), (2, _f32(2e-3))],
                   "skipped": [(1, 0.0), (2, 1.0)], "val_loss": [(2, 4.5)], "val_ppl": [(2, 90.0)]}


def test_a_run_logs_to_tensorboard_what_metrics_jsonl_holds(tmp_path):
    from megalm.train import run
    run(load("model=gpt_tiny", "data=mock", "logging.tensorboard=true", "trainer.max_steps=3",
             "trainer.micro_batch_size=4", "trainer.global_batch_size=4", "trainer.eval_steps=1",
             "trainer.eval_interval=2", "trainer.log_interval=1", "trainer.progress_bar=false",
             "trainer.num_threads=1", "cluster.peak_flops=1e12", "checkpoint.save=false"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = _scalars(tmp_path / "tensorboard")
    for tag in ("loss", "lr", "grad_norm", "val_loss"):
        want = [(r["step"], _f32(r[tag])) for r in records if tag in r]
        assert got[tag] == want, tag
    assert [step for step, _ in got["loss"]] == [1, 2, 3]
    assert [step for step, _ in got["val_loss"]] == [0, 2, 3]  # at the start, eval_interval, the end
    assert got["loss"][0][1] == pytest.approx(np.log(256), rel=0.05)  # a fresh model over 256 tokens


def test_wandb_online_without_a_login_says_how_to_log_in(tmp_path):
    """logging.wandb.mode=online with no API key is megalm's ConfigError saying what to do, not wandb's
    UsageError: a real wandb.init, in a process whose environment holds no key (and, with error reporting
    off, wandb touches no network before refusing)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb"), WANDB_ERROR_REPORTING="false",
               NETRC=str(tmp_path / ".netrc"))
    code = ("from pathlib import Path\n"
            "from megalm.config import WandbConfig\n"
            "from megalm.errors import ConfigError\n"
            "from megalm.training.metrics import WandbSink\n"
            "try:\n"
            "    WandbSink(WandbConfig(mode='online'), Path('.'), {})\n"
            "except ConfigError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout.strip()
    assert said.startswith("logging.wandb.mode=online: wandb did not start (") and said.endswith(
        "run `wandb login` or set WANDB_API_KEY, or set logging.wandb.mode=offline (or disabled)"), said
