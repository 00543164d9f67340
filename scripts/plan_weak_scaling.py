"""megalm.plan at the H100 weak-scaling layouts Megatron-Core publishes, beside its figures.

    python scripts/plan_weak_scaling.py [--json FILE]

The layouts and figures are those of the table in the Megatron-LM README ("Performance Benchmarking",
images/model_table.png, added 2024-07-15): GPT models of 1.7B-462B parameters on 48-6144 H100s, vocabulary
131072, sequence 4096, data-parallel size 48, run with --overlap-grad-reduce --overlap-param-gather and
--tp-comm-overlap. The README gives no micro-batch size, sequence-parallel or recomputation setting; this
plans micro-batch 1, sequence parallelism wherever tp > 1, no recomputation, the distributed optimizer (ZeRO-1),
untied input and output embeddings (12 L h^2 + 2 V h gives the table's sizes) and learned positions.

Each layout is planned twice on cluster=slurm_h100:
- before: trainer.mixed_precision=autocast, 25 MB buckets, the ZeRO all-gather waited on after the update
  (megalm's settings before main parameters, Megatron's bucket sizing and the overlapped gather);
- after: trainer.mixed_precision=main_params, buckets sized as Megatron sizes them, parallel.overlap_param_gather;
- after + tp overlap: the same with parallel.tp_comm_overlap (where tp > 1), as Megatron's --tp-comm-overlap.

Where the step goes, on the slowest pipeline rank, as shares of the planned step: the matmuls at the
profile's efficiency, the bytes outside them, tp collectives, pipeline bubble, and the tail after the last
backward (gradient reduction beyond the backward that hides it, the parameter gather, the optimizer step).
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List

# (name, heads, hidden, layers, tp, pp, dp, global batch, published TFLOP/s a GPU, published MFU %)
MEGATRON_CORE_H100 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1, 49),
    ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7, 42),
    ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8, 44),
    ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9, 47),
]

MODES = {
    "before": ["trainer.mixed_precision=autocast", "parallel.bucket_size_mb=25", "parallel.overlap_param_gather=false"],
    "after": ["trainer.mixed_precision=main_params", "parallel.overlap_param_gather=true"],
    "after + tp overlap": ["trainer.mixed_precision=main_params", "parallel.overlap_param_gather=true",
                           "parallel.tp_comm_overlap=true"],
}


def overrides(row) -> List[str]:
    _, heads, hidden, layers, tp, pp, dp, batch, _, _ = row
    return ["model=gpt_175b", f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.num_attention_heads={heads}", "model.seq_length=4096", "model.vocab_size=131072",
            "model.tie_embeddings=false", "cluster=slurm_h100", f"cluster.nodes={tp * pp * dp // 8}",
            "trainer.precision=bf16", "trainer.micro_batch_size=1", f"trainer.global_batch_size={batch}",
            f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", "parallel.zero_stage=1",
            f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}", "parallel.recompute=none"]


def breakdown(cfg, result: Dict) -> Dict[str, float]:
    """Shares of the step on the pipeline rank that finishes last (the one with the largest tail)."""
    from megalm.plan.flops import stage_work
    from megalm.plan.schedules import stage_layers
    est = result["estimate"]
    step, pipe, m = est["step_seconds"], est["pipeline_seconds"], est["micro_batches"]
    after = est["after_backward"]
    r = max(after, key=lambda k: sum(after[k].values()))
    layers = stage_layers(cfg, cfg.parallel.pp)  # one stage a rank: no virtual stages here
    work = stage_work(cfg, layers[r], r == len(layers) - 1, cfg.parallel.tp)
    matmul = m * (work.forward + work.backward) / (est["peak_flops"] * cfg.cluster.matmul_efficiency)
    bubble = est["bubble"][r] * pipe
    tp = est["tp_exposed_seconds"][r]  # what the rank waits on (all of it without tp_comm_overlap)
    tail = after[r]
    return {"step_s": step, "mfu": est["mfu"], "matmul": matmul / step, "traffic": (pipe - bubble - tp - matmul) / step,
            "tp": tp / step, "bubble": bubble / step, "dp_reduce": tail["dp_reduce"] / step,
            "dp_gather": tail["dp_gather"] / step, "optimizer": tail["optimizer"] / step,
            "other": (tail["embedding"] + tail["other"]) / step,
            "peak_gb": max(q["peak_bytes"] for q in result["positions"]) / 1e9,
            "fits": all(q["fits"] for q in result["positions"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every row's numbers to this file")
    args = parser.parse_args()
    from megalm.plan import compose, plan
    rows = []
    for row in MEGATRON_CORE_H100:
        got = {}
        for mode, extra in MODES.items():
            if row[4] == 1 and "parallel.tp_comm_overlap=true" in extra:
                continue  # no tensor parallelism to overlap
            cfg, world = compose(overrides(row) + extra)
            got[mode] = breakdown(cfg, plan(cfg, world))
        rows.append({"model": row[0], "layout": f"tp{row[4]} pp{row[5]} dp{row[6]}", "gpus": row[4] * row[5] * row[6],
                     "published_tflops": row[8], "published_mfu": row[9], **got})
    keys = ("matmul", "traffic", "tp", "bubble", "dp_reduce", "dp_gather", "optimizer", "other")
    print("| model | layout | published MFU | megalm | planned MFU | step s | matmul / traffic / tp / bubble / "
          "dp reduce / dp gather / optimizer / other, % of the step | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for mode in (mode for mode in MODES if mode in r):
            x = r[mode]
            shares = " / ".join(f"{100 * x[k]:.0f}" for k in keys)
            peak = f"{x['peak_gb']:.1f}" + ("" if x["fits"] else " (over 80)")
            print(f"| {r['model']} | {r['layout']} | {r['published_mfu']}% | {mode} | {100 * x['mfu']:.1f}% | "
                  f"{x['step_s']:.2f} | {shares} | {peak} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
