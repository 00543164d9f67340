#!/usr/bin/env bash
# English -> French on Django's UI strings: pretrain the embedded default, fine-tune it on 706
# pairs (packed), then score greedy translations of 78 held-out strings (BLEU, chrF, exact match).
# Needs the catalogues and translation extras (both in the dev install). About 10 minutes on 2 cores.
set -euo pipefail
OUT=${OUT:-runs/translation}
python -m megalm.data.catalogues --language fr --output "$OUT/data"
[ -f "$OUT/pretrain/checkpoints/latest" ] || python -m megalm.train hydra.run.dir="$OUT/pretrain"
python -m megalm.train hydra.run.dir="$OUT/sft" data=sft data.paths="[$OUT/data/train.jsonl]" \
    data.packing=true data.tokenizer.model="$OUT/pretrain/tokenizer.model" \
    checkpoint.load="$OUT/pretrain/checkpoints" checkpoint.finetune=true \
    trainer.max_steps=150 trainer.eval_interval=50 optimizer.lr=3e-4 optimizer.warmup_steps=10
python -m megalm.evaluate "$OUT/sft" generate --data "$OUT/data/test.jsonl" --max-new-tokens 32
python -m megalm.evaluate "$OUT/pretrain" generate --data "$OUT/data/test.jsonl" --max-new-tokens 32
