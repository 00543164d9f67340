"""Evaluation at tensor-parallel, pipeline and data-parallel layouts against the single process:
the layouts two ranks run (LAYOUTS, as (tp, pp, dp)), every job evaluated at each of them on the
same two ranks (evaluate_at_layouts), and the numbers compared within fp32 rounding
(assert_same_numbers)."""

import pytest

from megalm.evaluate import _evaluate

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (tp, pp, dp) on two ranks
NUMERIC = ("loss", "nll", "ppl", "adjusted_ppl", "accuracy", "accuracy_norm", "exact_match", "bleu", "chrf",
           "f1", "mcc", "pearson", "spearman")


def assert_same_numbers(single, layout, where):
    for key in NUMERIC:
        if key in single:
            assert layout[key] == pytest.approx(single[key], rel=1e-5), (where, key)


def evaluate_at_layouts(jobs):
    """Each (run, task, data, options) at every layout, on the same two ranks of one group."""
    out = []
    for tp, pp, dp in LAYOUTS:
        out.append([_evaluate(run, task, data, tp=tp, pp=pp, dp=dp, write=False, **options)
                    for run, task, data, options in jobs])
    return out


def keywords_and_group_timeout(**kwargs):
    """On a rank: the keywords it was called with, and how long its process group's collectives wait."""
    import torch
    import torch.distributed as dist
    return kwargs, dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
