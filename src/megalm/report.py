"""`python -m megalm.report RUN_OR_SWEEP_DIR... [--output FILE]`: the curves of one or many runs, side by side.

A run directory is one holding metrics.jsonl (megalm.training.metrics); any other directory given is
searched below for them (a Hydra sweep: one run a job). The figure has four panels over the optimizer
step, each axis labelled with its unit: training and validation loss together (solid and dashed), a fine-tune's
validation task metric (accuracy...) or else the validation perplexity, learning rate and throughput (tokens/s),
titled with the model and what sets the run apart; one colour a run,
labelled by the overrides its sweep job ran with that set it apart from the other runs drawn (job.json,
written by megalm.train in a multirun), or else by its directory. Written as PNG with matplotlib (its
Figure API: no display needed), to --output or to report.png in the one directory given. A run also draws its own curves to curves.png when it ends
(`logging.curves`), and a sweep's jobs keep summary.md / summary.csv in the sweep directory up to date
(`write_sweep_summary`): one row a job, with its overrides, final validation loss, tokens/s, MFU,
parameters and status.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megalm.errors import ConfigError, cli_errors

PROG = "megalm.report"
METRICS = "metrics.jsonl"
JOB = "job.json"
PANELS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("loss", "loss (nats a token)", ("loss", "val_loss")),
    ("validation metric", "", ()),  # a fine-tune's task metrics (val_acc...), else the validation perplexity
    ("learning rate", "learning rate", ("lr",)),
    ("throughput", "tokens/s", ("tokens_per_s",)))
"""(panel title, y-axis label, metrics.jsonl keys drawn), in the figure's reading order."""
STYLE = {"loss": ("training", "-"), "val_loss": ("validation", "--")}
"""A key's name in the legend and its line style, where one panel draws two keys."""

Curve = Tuple[List[int], List[float]]


def find_runs(paths: Sequence[Path]) -> List[Path]:
    """The run directories `paths` name: each one holding metrics.jsonl, else every directory below it
    that holds one (in natural order: job 2 before job 10)."""
    runs: List[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise ConfigError(f"{path} is not a directory; give run or sweep directories (each run holds {METRICS})")
        if (path / METRICS).is_file():
            runs.append(path)
            continue
        found = sorted((p.parent for p in path.rglob(METRICS)), key=_natural)
        if not found:
            raise ConfigError(f"no {METRICS} in or below {path}: is it a megalm run or sweep directory "
                              "(logging.jsonl=true)?")
        runs.extend(found)
    return runs


def _natural(path: Path):
    return [int(part) if part.isdigit() else part for part in path.parts]


def read_metrics(run_dir: Path) -> Dict[str, Curve]:
    """(steps, values) of every numeric key in the run's metrics.jsonl, in step order (a line torn by a
    kill is skipped)."""
    curves: Dict[str, Curve] = {}
    for line in (run_dir / METRICS).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = curves.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    return curves


def run_labels(runs: Sequence[Path]) -> List[str]:
    """Each run's legend entry: the overrides of its sweep job that not every run drawn shares (all of them
    for a single run), or its directory's name."""
    overrides = [(read_job(r) or {}).get("overrides") or [] for r in runs]
    shared = set.intersection(*map(set, overrides)) if len(runs) > 1 else set()
    labels = []
    for run, own in zip(runs, overrides):
        kept = [o for o in own if o not in shared]
        labels.append(" ".join(kept) if kept else (run.name or str(run)))
    return labels


def read_job(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((run_dir / JOB).read_text())
    except (OSError, ValueError):
        return None


def task_metrics(curves: Dict[str, Curve]) -> List[str]:
    """The validation metrics a run logged beyond its loss and perplexity (a fine-tune's accuracy, its QA head's
    start and end accuracy)."""
    return sorted(k for k in curves if k.startswith("val_") and k not in ("val_loss", "val_ppl"))


def run_title(run: Path) -> str:
    """The model and what sets the run apart: its logging.title (by default the command line's overrides), its
    sweep job's overrides (job.json), or else the layout, precision, batch, learning rate and steps of its
    config.yaml."""
    import yaml  # PyYAML, a dependency of omegaconf
    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    model, par, tr, opt = (cfg.get(k) or {} for k in ("model", "parallel", "trainer", "optimizer"))
    job = read_job(run)
    if (cfg.get("logging") or {}).get("title"):
        apart = cfg["logging"]["title"]
    elif job and job.get("overrides"):
        apart = " ".join(job["overrides"])
    elif tr:
        layout = " ".join(f"{k}{par[k]}" for k in ("tp", "pp", "dp", "cp") if par.get(k, 1) != 1) or "one process"
        apart = (f"{layout}, {tr.get('precision')}, batch {tr.get('global_batch_size')} x {model.get('seq_length')} "
                 f"tokens, lr {opt.get('lr')}, {tr.get('max_steps')} steps")
    else:
        apart = run.name
    return f"{model.get('name', run.name)}: {apart}"


def draw(runs: Sequence[Path], title: Optional[str] = None):
    """The matplotlib Figure of `runs`' curves (PANELS, one colour a run; training and validation loss together,
    solid and dashed)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    data = list(zip(run_labels(runs), map(read_metrics, runs)))
    metrics = sorted({k for _, curves in data for k in task_metrics(curves)})
    for ax, (name, unit, keys) in zip(axes.flat, PANELS):
        if name == "validation metric":
            keys = tuple(metrics) or ("val_ppl",)
            name = "validation " + (", ".join(k[4:].replace("acc", "accuracy") for k in metrics) if metrics
                                    else "perplexity")
            unit = "accuracy (fraction right)" if metrics and all(k.endswith("acc") for k in metrics) else \
                "value" if metrics else "perplexity (e^loss)"
        drawn = set()
        for i, (label, curves) in enumerate(data):
            for j, key in enumerate(keys):
                if key in curves:
                    steps, values = curves[key]
                    ax.plot(steps, values, label=label, color=f"C{i % 10}", linestyle=_style(key, j), gid=key,
                            marker="o" if len(steps) < 20 or key.startswith("val_") else None, markersize=3)
                    drawn.add(key)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if keys == ("lr",):
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        else:  # the values themselves on the axis, not an offset added to small ticks
            ax.ticklabel_format(axis="y", useOffset=False)
        if len(drawn) > 1:  # which line is which key: the styles
            ax.legend([Line2D([], [], color="gray", linestyle=_style(k, j)) for j, k in enumerate(keys)],
                      [STYLE[k][0] if k in STYLE else k[4:] for k in keys], fontsize="small")
        if not drawn:
            ax.text(0.5, 0.5, f"no {' or '.join(keys)} in {METRICS}", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
    if len(data) > 1:
        handles = [Line2D([], [], color=f"C{i % 10}") for i in range(len(data))]
        labels = [label for label, _ in data]
        columns = 1 if max(map(len, labels)) > 60 else min(4, len(handles))
        fig.legend(handles, labels, loc="outside lower center", ncol=columns, fontsize="small")
    fig.suptitle(title or run_title(runs[0]) if len(runs) == 1 else title or _runs_title(runs))
    return fig


def _style(key: str, j: int) -> str:
    return STYLE[key][1] if key in STYLE else "-" if j == 0 else ":"


def _runs_title(runs: Sequence[Path]) -> str:
    """Many runs: how many, the model, and the overrides they all share."""
    shared = set.intersection(*(set((read_job(r) or {}).get("overrides") or []) for r in runs))
    model = run_title(runs[0]).split(":")[0]
    return f"{len(runs)} runs of {model}" + (f": {' '.join(sorted(shared))}" if shared else "")


def write_report(runs: Sequence[Path], output: Path, title: Optional[str] = None) -> Path:
    """Draw `runs` to the PNG `output` (written whole, then moved into place)."""
    fig = draw(runs, title)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    tmp.replace(output)
    return output


def write_run_curves(run_dir: Path) -> Optional[Path]:
    """A finished run's own curves.png (None when it wrote no metrics.jsonl)."""
    if not (run_dir / METRICS).is_file():
        return None
    return write_report([run_dir], run_dir / "curves.png")


# ---------------------------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------------------------

SUMMARY_FIELDS = ("job", "overrides", "status", "val_loss", "tokens_per_s", "mfu", "params", "error")


def job_record(overrides: Sequence[str], status: str, run_dir: Path, val_loss: Optional[float] = None,
               params: Optional[int] = None, error: Optional[str] = None) -> dict:
    """One sweep job's row: its metrics.jsonl gives the median logged tokens/s and MFU."""
    curves = read_metrics(run_dir) if (run_dir / METRICS).is_file() else {}

    def median(key: str) -> Optional[float]:
        values = curves.get(key, ([], []))[1]
        return statistics.median(values) if values else None
    if val_loss is None and "val_loss" in curves:
        val_loss = curves["val_loss"][1][-1]
    return {"overrides": list(overrides), "status": status, "val_loss": val_loss,
            "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "params": params, "error": error}


def write_job(run_dir: Path, record: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{JOB}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(run_dir / JOB)


def sweep_rows(sweep_dir: Path) -> List[dict]:
    """Every job.json below `sweep_dir`, with its directory relative to it as `job`, in natural order."""
    rows = []
    for path in sorted(sweep_dir.rglob(JOB), key=_natural):
        job = read_job(path.parent)
        if job is not None:
            rows.append({"job": str(path.parent.relative_to(sweep_dir)), **job})
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return " ".join(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_sweep_summary(sweep_dir: Path) -> List[dict]:
    """summary.csv and summary.md in `sweep_dir`: one row a job that has finished (job.json). Each file is
    written whole and moved into place, so jobs ending at once never leave a torn one: the last to
    write has read every row written before it."""
    rows = sweep_rows(sweep_dir)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k)) for k in SUMMARY_FIELDS})
    md = ["| " + " | ".join(SUMMARY_FIELDS) + " |", "|" + "---|" * len(SUMMARY_FIELDS)]
    md += ["| " + " | ".join(_cell(row.get(k)).replace("|", "\\|").replace("\n", " ") for k in SUMMARY_FIELDS) + " |"
           for row in rows]
    for name, text in (("summary.csv", buf.getvalue()), ("summary.md", "\n".join(md) + "\n")):
        tmp = sweep_dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.replace(sweep_dir / name)
    return rows


def _check_writable(output: Path) -> None:
    """Make --output's folder (as write_report does) and a file in it, or say why it cannot be written."""
    if output.is_dir():
        raise ConfigError(f"--output={output} is a directory; give the path of the .png to write")
    probe = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        probe.open("wb").close()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--output={output}: cannot write a file in {output.parent} ({e.strerror or e}); "
                          "give a .png path in a folder you can write to") from None


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, metavar="RUN_OR_SWEEP_DIR")
    parser.add_argument("--output", type=Path, default=None,
                        help="the PNG to write (default: report.png in the one directory given; required for several)")
    parser.add_argument("--title", default=None, help="the figure's title (default: the run's name, or 'N runs')")
    args = parser.parse_args(argv)
    with cli_errors(PROG):
        if args.output is None and len(args.dirs) > 1:
            raise ConfigError(f"{len(args.dirs)} directories given: say where the figure goes with --output FILE.png")
        output = args.output or args.dirs[0] / "report.png"
        if output.suffix.lower() != ".png":
            raise ConfigError(f"--output={output}: the report is a PNG; give a path ending in .png")
        runs = find_runs(args.dirs)
        _check_writable(output)  # before drawing, not as PIL's traceback after it
        write_report(runs, output, args.title)
        if len(args.dirs) == 1 and any((args.dirs[0] / d / JOB).is_file() for d in os.listdir(args.dirs[0])
                                       if (args.dirs[0] / d).is_dir()):
            write_sweep_summary(args.dirs[0])
        print(f"{len(runs)} run(s) drawn to {output}")


if __name__ == "__main__":
    main()
