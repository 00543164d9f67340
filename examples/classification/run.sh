#!/usr/bin/env bash
# Sentiment of movie-review sentences: pretrain the embedded BERT on the stdlib's docstrings,
# fine-tune it as a two-class classifier on 160 labelled movie-review sentences (gensim's copy),
# then score the 40 held out (accuracy, F1, Matthews). Needs the sentiment and classify extras (both
# in the dev install). About 8 minutes on 2 cores.
set -euo pipefail
OUT=${OUT:-runs/classification}   # SEED (default 1234): the fine-tune's seed (data order, dropout, the classifier)
python -m megalm.data.sentiment "$OUT/data"
[ -f "$OUT/pretrain/checkpoints/latest" ] || python -m megalm.train hydra.run.dir="$OUT/pretrain" \
    model=bert_cpu data=stdlib_prose
python -m megalm.train hydra.run.dir="$OUT/finetune_seed${SEED:-1234}" model=bert_cpu model.num_labels=2 \
    data=classification data.task=fasttext data.labels=[neg,pos] \
    data.paths="[$OUT/data/train.txt]" data.valid_paths="[$OUT/data/dev.txt]" \
    data.tokenizer.model="$OUT/pretrain/tokenizer.model" \
    checkpoint.load="$OUT/pretrain/checkpoints" checkpoint.finetune=true \
    trainer.epochs=10 trainer.eval_interval=50 trainer.eval_steps=5 optimizer.lr=1e-4 optimizer.warmup_steps=20 \
    trainer.seed="${SEED:-1234}"
python -m megalm.evaluate "$OUT/finetune_seed${SEED:-1234}" classify --data "$OUT/data/dev.txt"
