#!/usr/bin/env bash
# MFU of gpt_1_3b-shaped training in bf16 on one CUDA device: eager, whole-model compiled,
# per-block compiled (autocast: fp32 weights) and eager with trainer.mixed_precision=main_params
# (bf16 weights, fp32 main parameters), one short run each, then a table. For a machine with a CUDA device and
# megalm installed (pip install -e .); on a machine without one it says so and does nothing.
#
#   bash scripts/gpu_check.sh [out_dir]          # about 5 minutes on an H100 / H200
#
# Each run: model=$MODEL (default gpt_1_3b: 24 layers, hidden 2048, seq 2048, vocab 50257),
# data=mock, trainer.precision=bf16, micro-batch $MICRO_BATCH (default 4), $STEPS steps (default 30)
# logged every 10; the row is the last record (steps STEPS-9..STEPS), so the first step's compilation
# is not in it. MFU is against the device's dense bf16 peak from its datasheet when the name is known
# (A100 312 T, H100 / H200 989 T), else against a bf16 matmul measured at start-up (cluster=local's
# rule). $GPU_CHECK_EXTRA (space-separated overrides) is added to every run. GPU_CHECK_CPU=1 runs
# it on a machine without a CUDA device too, so the script itself can be tried on CPU with a small
# MODEL (the tests do: tests/test_bench.py).
set -euo pipefail

OUT="${1:-${OUT:-gpu_check_out}}"
STEPS="${STEPS:-30}"
MODEL="${MODEL:-gpt_1_3b}"
MICRO_BATCH="${MICRO_BATCH:-4}"
PY="${PYTHON:-python}"
read -r -a EXTRA <<< "${GPU_CHECK_EXTRA:-}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    if [ "${GPU_CHECK_CPU:-0}" != 1 ]; then
        echo "gpu_check: no CUDA device here (or no torch): nothing to measure"
        exit 0
    fi
    echo "gpu_check: no CUDA device here; GPU_CHECK_CPU=1, so the runs go on the CPU"
fi

mkdir -p "$OUT"
NAME="$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')")"
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
    if CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" timeout 300 "$PY" -m megalm.train model="$MODEL" data=mock \
        trainer.precision=bf16 trainer.micro_batch_size="$MICRO_BATCH" trainer.global_batch_size="$MICRO_BATCH" \
        trainer.max_steps="$STEPS" trainer.log_interval=10 trainer.eval_interval=0 trainer.progress_bar=false \
        checkpoint.save=false cluster.peak_flops="$PEAK" hydra.run.dir="$dir" "$@" ${EXTRA[@]+"${EXTRA[@]}"} \
        > "$OUT/$label.log" 2>&1; then
        echo "$label: done in $((SECONDS - start)) s"
    else
        echo "$label: failed after $((SECONDS - start)) s (last lines of $OUT/$label.log):"
        tail -5 "$OUT/$label.log"
    fi
}

run eager
run compiled trainer.compile=model
run compiled_blocks trainer.compile=blocks
run main_params trainer.mixed_precision=main_params

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"\n| run | steps | tokens/s | TFLOP/s | MFU | peak memory GB | compile s |")
print("|---|---|---|---|---|---|---|")
for label in ("eager", "compiled", "compiled_blocks", "main_params"):
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
