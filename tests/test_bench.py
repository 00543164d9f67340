"""Smoke test of scripts/bench.py: it runs end to end and writes sane JSON. Never a timing test."""

import importlib.util
import json
from pathlib import Path

import torch
import transformers  # noqa: F401  a dev dependency; the benchmark compares against it

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def test_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("megalm_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out_path = tmp_path / "bench.json"
    # The current thread count, so the test leaves torch as it found it for the tests after it.
    bench.main(["--model", "gpt_tiny", "--micro-batch", "2", "--rounds", "1", "--steps", "2", "--warmup", "1",
                "--peak-seconds", "0.02", "--threads", str(torch.get_num_threads()),
                "--modes", "eager,bf16,eager+fused-loss,bf16+fused-loss", "--profile", "1",
                "--json", str(out_path)])
    out = json.loads(out_path.read_text())
    assert set(out["results"]) == {"megalm/eager", "hf/eager", "megalm/bf16", "hf/bf16", "megalm/eager+fused-loss",
                                   "hf/eager+fused-loss", "megalm/bf16+fused-loss", "hf/bf16+fused-loss"}
    assert all(r["tokens_per_s"] > 0 for r in out["results"].values())
    assert {"megalm/bf16 : hf/bf16", "megalm/bf16 : megalm/eager",
            "megalm/eager+fused-loss : megalm/eager"} <= set(out["paired_ratios"])
    # each bf16 mode against HF's bf16 eager step, the baseline a speed target names
    assert "megalm/bf16+fused-loss : hf/bf16" in out["paired_ratios"]
    # The fused head + loss trains from the same weights on the same batches as the plain one.
    plain, fused = (out["results"][f"megalm/eager{s}"]["final_loss"] for s in ("", "+fused-loss"))
    assert abs(fused - plain) < 1e-4 * abs(plain)
    assert out["params"]["megalm"] == out["params"]["hf"] > 0
    assert out["initial_logit_max_abs_diff"] < 1e-3
    assert out["ratio"] > 0 and "paired_ratio" in out
    assert set(out["profiles"]) == {"megalm/eager", "megalm/bf16", "megalm/eager+fused-loss", "megalm/bf16+fused-loss"}
    assert all(0 < p["matmul_share"] < 1 and p["top"] for p in out["profiles"].values())


def _script(name):
    spec = importlib.util.spec_from_file_location(f"megalm_{name}", BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_runs_sets_curves_side_by_side(tmp_path, capsys):
    for name, losses, vals in (("fp32", [6.0, 5.0, 4.0, 3.0], (8.0, 4.5, 4.0)), ("bf16", [6.2, 5.2, 4.2, 3.2], (8.0, 4.6, 4.1))):
        (tmp_path / name).mkdir()
        rows = [{"step": 0, "val_loss": vals[0]}]
        for step, loss in zip((5, 10, 15, 20), losses):
            rows.append({"step": step, "loss": loss, "tokens_per_s": 100.0 * step})
            if step in (10, 20):
                rows.append({"step": step, "val_loss": vals[step // 10]})
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.json"
    _script("compare_runs").main([str(tmp_path / "fp32"), str(tmp_path / "bf16"), "--json", str(out)])
    table = json.loads(out.read_text())
    assert table["last_step"] == 20
    # steps 15 and 20 make the last interval: (3.2 + 4.2) / 2 for bf16; 4.1 / 4.0 - 1 against fp32
    assert abs(table["curves"]["bf16"]["20"]["train_loss"] - 3.7) < 1e-9
    assert table["curves"]["bf16"]["0"]["train_loss"] is None
    assert abs(table["summary"]["bf16"]["relative_to_first"] - 0.025) < 1e-9
    assert table["summary"]["fp32"]["relative_to_first"] == 0.0
    assert "+2.50% against fp32" in capsys.readouterr().out


def test_bench_optimizer_and_bench_input_smoke(tmp_path):
    _script("bench_optimizer").main(["--model", "gpt_tiny", "--steps", "1", "--rounds", "1",
                                     "--json", str(tmp_path / "opt.json")])
    opt = json.loads((tmp_path / "opt.json").read_text())
    assert set(opt["ms_per_step"]) == {"fused", "foreach", "for_loop"} and opt["ratio_to_fused"]["fused"] == 1.0
    _script("bench_input").main(["model=gpt_tiny", "data=mock", f"trainer.num_threads={torch.get_num_threads()}",
                                 "--steps", "2", "--rounds", "1", "--warmup", "1", "--json", str(tmp_path / "in.json")])
    got = json.loads((tmp_path / "in.json").read_text())
    assert got["prefetch"] == 2 and got["prefetch_time_data_s"] >= 0 and got["plain_steps_per_s"] > 0


def test_bench_moe_smoke(tmp_path):
    """scripts/bench_moe.py: megalm's mixture of experts and Mixtral from the same weights (their logits are
    checked equal inside), trained side by side."""
    _script("bench_moe").main(["--model", "moe_tiny", "--steps", "1", "--rounds", "1", "--warmup", "1",
                               "--json", str(tmp_path / "moe.json")])
    got = json.loads((tmp_path / "moe.json").read_text())
    assert got["initial_logit_max_abs_diff"] < 1e-4 and got["paired_ratio"] > 0
    assert set(got["results"]) == {"megalm", "hf"} and got["config"]["num_experts"] == 4


def test_gpu_check_does_nothing_without_a_cuda_device(tmp_path):
    import subprocess
    import sys
    if torch.cuda.is_available():
        import pytest
        pytest.skip("a CUDA device is here: the script would measure for minutes")
    done = subprocess.run(["bash", str(BENCH.parent / "gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout and not (tmp_path / "out").exists()


def test_gpu_check_tried_on_cpu_fills_its_table_from_the_runs_metrics(tmp_path):
    """GPU_CHECK_CPU=1 with a small model: the script's four runs train, and its table is read from
    what they logged (a row of dashes is a run without metrics)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_CPU": "1", "MODEL": "gpt_tiny", "STEPS": "10",
           "MICRO_BATCH": "2", "GPU_CHECK_EXTRA": "trainer.compile_backend=aot_eager trainer.num_threads=1",
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(BENCH.parent / "gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| run ")}
    assert set(rows) == {"eager", "compiled", "compiled_blocks", "main_params"}, done.stdout
    for label, (steps, tokens_per_s, tflops, mfu, memory, compile_s) in rows.items():
        assert steps == "10" and float(tokens_per_s) > 0 and mfu.endswith("%") and float(memory) > 0, done.stdout
        assert (compile_s == "-") == (label in ("eager", "main_params")), done.stdout  # only the compiled runs compiled


def test_bench_loss_smoke(tmp_path):
    """scripts/bench_loss.py, in its own process (it sets malloc's thresholds for the whole process): the three
    paths give the same loss, and the fused ones keep less for backward than the unfused one's log-softmax."""
    import subprocess
    import sys
    out = tmp_path / "loss.json"
    done = subprocess.run([sys.executable, str(BENCH.parent / "bench_loss.py"), "--vocab", "1000", "--hidden", "16",
                           "--tokens", "64", "--chunk", "24", "--dtypes", "fp32", "--repeats", "1", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {r["path"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"unfused", "in_forward", "recompute"}
    for path in ("in_forward", "recompute"):
        assert rows[path]["loss_rel_diff"] < 1e-5
        assert rows[path]["saved_mb"] < rows["unfused"]["saved_mb"]
