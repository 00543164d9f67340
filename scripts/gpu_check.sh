#!/usr/bin/env bash
# MFU of gpt_1_3b-shaped training in bf16 on one CUDA device: eager, whole-model compiled and
# per-block compiled, one short run each, then a table. For a machine with a CUDA device and
# megalm installed (pip install -e .); on a machine without one it says so and does nothing.
#
#   bash scripts/gpu_check.sh [out_dir]          # about 5 minutes on an H100 / H200
#
# Each run: model=gpt_1_3b (24 layers, hidden 2048, seq 2048, vocab 50257), data=mock,
# trainer.precision=bf16, micro-batch 4, STEPS steps (default 30) logged every 10; the row is the
# last record (steps STEPS-9..STEPS), so the first step's compilation is not in it. MFU is against
# the device's dense bf16 peak from its datasheet when the name is known (A100 312 T, H100 / H200
# 989 T), else against a bf16 matmul measured at start-up (cluster=local's rule).
set -euo pipefail

OUT="${1:-${OUT:-gpu_check_out}}"
STEPS="${STEPS:-30}"
PY="${PYTHON:-python}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device here (or no torch): nothing to measure"
    exit 0
fi

mkdir -p "$OUT"
NAME="$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
PEAK="$("$PY" - "$NAME" <<'EOF'
import sys
name = sys.argv[1]
peaks = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16, NVIDIA's datasheets
print(next((repr(v) for k, v in peaks.items() if k in name), "null"))
EOF
)"
echo "gpu_check: $NAME, bf16 peak ${PEAK} (null: measured), torch $("$PY" -c 'import torch; print(torch.__version__)')"

run() {  # run <label> <overrides...>
    local label="$1"; shift
    local dir="$OUT/$label"
    rm -rf "$dir"
    local start=$SECONDS
    if CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" timeout 300 "$PY" -m megalm.train model=gpt_1_3b data=mock \
        trainer.precision=bf16 trainer.micro_batch_size=4 trainer.global_batch_size=4 \
        trainer.max_steps="$STEPS" trainer.log_interval=10 trainer.eval_interval=0 trainer.progress_bar=false \
        checkpoint.save=false cluster.peak_flops="$PEAK" hydra.run.dir="$dir" "$@" > "$OUT/$label.log" 2>&1; then
        echo "$label: done in $((SECONDS - start)) s"
    else
        echo "$label: failed after $((SECONDS - start)) s (last lines of $OUT/$label.log):"
        tail -5 "$OUT/$label.log"
    fi
}

run eager
run compiled trainer.compile=model
run compiled_blocks trainer.compile=blocks

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"\n| run | steps | tokens/s | TFLOP/s | MFU | peak memory GB | compile s |")
print("|---|---|---|---|---|---|---|")
for label in ("eager", "compiled", "compiled_blocks"):
    path = out / label / "metrics.jsonl"
    records = [json.loads(line) for line in path.open()] if path.exists() else []
    train = [r for r in records if "tokens_per_s" in r]
    if not train:
        print(f"| {label} | - | - | - | - | - | - |")
        continue
    last = train[-1]
    compile_s = next((r["compile_s"] for r in train if "compile_s" in r), None)
    print(f"| {label} | {last['step']} | {last['tokens_per_s']:.0f} | {last['tflops_per_device']:.1f} | "
          f"{100 * last['mfu']:.1f}% | {last.get('peak_mem_gb', float('nan')):.1f} | "
          f"{'-' if compile_s is None else f'{compile_s:.0f}'} |")
EOF
