"""The classify task of megalm.evaluate: a fine-tuned classifier's metrics over a whole file.

The run's own data.task reads the file (GLUE TSV or JSON lines), the model predicts every
example, and the task's metrics are computed over all of them at once (F1, Matthews correlation
and rank correlations do not average over batches): accuracy always; F1 of class 1 for the
two-class GLUE tasks QQP (and any two-class JSON lines or fastText file), macro F1 with more classes; Matthews
correlation for CoLA; for a regression (STS-B) Pearson and Spearman correlations and the mean
squared error. scikit-learn and scipy compute them (the `megalm[classify]` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from megalm.data.loader import collate
from megalm.data.tasks.classification import CHOICE_TASKS, read_examples
from megalm.errors import ConfigError
from megalm.evaluate.layout import across_replicas
from megalm.models import family_of


def metrics(task: str, predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> Dict[str, float]:
    """The task's metrics of predicted classes (or values, for a regression) against the labels."""
    try:
        from scipy.stats import pearsonr, spearmanr
        from sklearn.metrics import f1_score, matthews_corrcoef
    except ImportError:
        raise ConfigError("the classify task computes its metrics with scikit-learn and scipy: "
                          "pip install 'megalm[classify]'") from None
    if task in CHOICE_TASKS:  # the index of the right choice: accuracy, as Megatron's RACE reports
        return {"accuracy": float(np.mean(predictions == labels))}
    if num_labels == 1:
        return {"pearson": float(pearsonr(predictions, labels)[0]), "spearman": float(spearmanr(predictions, labels)[0]),
                "mse": float(np.mean((predictions - labels) ** 2))}
    out = {"accuracy": float(np.mean(predictions == labels))}
    if num_labels == 2 and task in ("qqp", "jsonl", "fasttext"):
        out["f1"] = float(f1_score(labels, predictions, pos_label=1, average="binary"))
    elif num_labels > 2:
        out["macro_f1"] = float(f1_score(labels, predictions, average="macro", labels=list(range(num_labels))))
    if task in ("cola", "jsonl", "fasttext"):
        out["mcc"] = float(matthews_corrcoef(labels, predictions))
    return out


@torch.no_grad()
def classify(cfg, model, tokenizer, path: Path, batch_size: int) -> Dict[str, Any]:
    m = cfg.model
    num_labels, num_choices = getattr(m, "num_labels", 0), getattr(m, "num_choices", 0)
    if not (num_labels or num_choices):
        raise ConfigError(f"the classify task scores a fine-tuned classifier (model.num_labels or model.num_choices "
                          f"> 0); this run is model.arch={m.arch} with no classifier")
    family = family_of(m.arch)
    make = family.samples(m).classification(tokenizer, m.seq_length)
    examples = read_examples([str(path)], cfg.data.task, cfg.data.labels, num_labels, num_choices)
    model.eval()
    device = next(model.parameters()).device

    def predict(part) -> List[float]:
        out_all: List[float] = []
        for b in range(0, len(part), batch_size):
            batch = {k: v.to(device) for k, v in collate([make(e) for e in part[b:b + batch_size]]).items()}
            out = model(*(batch[k] for k in family.inputs))
            out = (model.predictions(out, batch) if hasattr(model, "predictions") else out).float().cpu()
            out_all += (out[:, 0] if num_labels == 1 else out.argmax(-1)).tolist()
        return out_all

    predictions = np.array(across_replicas(model, predict, examples))  # data-parallel replicas: a share each
    labels = np.array([e.label for e in examples])
    return {"examples": len(examples), "data_task": cfg.data.task,
            **metrics(cfg.data.task, predictions, labels, num_labels or num_choices)}
