#!/usr/bin/env bash
# Code generation: pretrain the embedded default on the standard library's sources, fine-tune it to
# write a function's body from its signature and docstring (the stdlib's own functions), then
# pass@k on the HumanEval problems that fit its 256-token context, every completion run in the
# sandbox. Needs the code extra (in the dev install). About 25 minutes on 2 cores.
set -euo pipefail
OUT=${OUT:-runs/code_generation}   # SEED (default 1234): the fine-tune's seed (data order, dropout)
SFT="sft_seed${SEED:-1234}"   # a folder per seed: another seed fine-tunes afresh instead of resuming this one
HERE=$(dirname "$0")
python "$HERE/make_pairs.py" "$OUT/pairs.jsonl"
[ -f "$OUT/pretrain/checkpoints/latest" ] || python -m megalm.train hydra.run.dir="$OUT/pretrain"
python -m megalm.train hydra.run.dir="$OUT/$SFT" data=sft data.paths="[$OUT/pairs.jsonl]" \
    data.tokenizer.model="$OUT/pretrain/tokenizer.model" data.split="'95,5,0'" \
    checkpoint.load="$OUT/pretrain/checkpoints" checkpoint.finetune=true \
    trainer.max_steps=150 trainer.eval_interval=50 optimizer.lr=3e-4 optimizer.warmup_steps=10 \
    trainer.seed="${SEED:-1234}"
for run in "$SFT" pretrain; do
    python -m megalm.evaluate "$OUT/$run" code --data humaneval --skip-long --max-new-tokens 96 \
        --samples 5 --k 1 5 --temperature 0.8
done
