#!/usr/bin/env bash
# English -> French on Django's UI strings, a decoder-only GPT and an encoder-decoder T5 of the same
# size side by side: each pretrained on the standard library (GPT on its sources, T5 by span
# corruption on its docstrings), fine-tuned on the same 706 pairs, then scored on greedy translations
# of the same 78 held-out strings (BLEU, chrF, exact match).
# Needs the catalogues and translation extras (both in the dev install). About 25 minutes on 2 cores.
set -euo pipefail
OUT=${OUT:-runs/translation}   # SEED (default 1234): the fine-tunes' seed (data order, dropout)
S="seed${SEED:-1234}"   # fine-tunes in a folder per seed: another seed fine-tunes afresh instead of resuming
python -m megalm.data.catalogues --language fr --output "$OUT/data"
FINETUNE=(data=sft data.paths="[$OUT/data/train.jsonl]" checkpoint.finetune=true trainer.max_steps=150
          trainer.eval_interval=50 optimizer.lr=3e-4 optimizer.warmup_steps=10 trainer.seed="${SEED:-1234}")

# Decoder-only: the embedded default (gpt_cpu, 5.5M parameters), the pairs packed several a sequence.
[ -f "$OUT/pretrain/checkpoints/latest" ] || python -m megalm.train hydra.run.dir="$OUT/pretrain"
python -m megalm.train hydra.run.dir="$OUT/sft_$S" "${FINETUNE[@]}" data.packing=true \
    data.tokenizer.model="$OUT/pretrain/tokenizer.model" checkpoint.load="$OUT/pretrain/checkpoints"

# Encoder-decoder: t5_cpu cut to 2 + 2 layers (5.8M parameters), 160 decoder positions (the longest
# French string takes 128 tokens of the docstrings' tokenizer); the English side to the encoder, the
# French side to the decoder, one pair a sample, 64 a step (about as many pairs a step as GPT's packed
# sequences hold).
T5=(model=t5_cpu model.num_layers=4 model.decoder_seq_length=160)
[ -f "$OUT/t5_pretrain/checkpoints/latest" ] || python -m megalm.train hydra.run.dir="$OUT/t5_pretrain" \
    "${T5[@]}" data=stdlib_prose_t5
python -m megalm.train hydra.run.dir="$OUT/t5_sft_$S" "${T5[@]}" "${FINETUNE[@]}" \
    trainer.global_batch_size=64 trainer.micro_batch_size=32 \
    data.tokenizer.model="$OUT/t5_pretrain/tokenizer.model" checkpoint.load="$OUT/t5_pretrain/checkpoints"

for run in pretrain "sft_$S" t5_pretrain "t5_sft_$S"; do
    python -m megalm.evaluate "$OUT/$run" generate --data "$OUT/data/test.jsonl" --max-new-tokens 32
done
