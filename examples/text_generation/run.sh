#!/usr/bin/env bash
# Text generation: pretrain the embedded default, then score it on text it never saw (Python's
# LICENSE.txt, which sits beside the standard library's sources but is not a .py file) with
# disjoint and overlapping windows, predict the last word of its paragraphs (LAMBADA's cloze, strict
# and not), and sample from it. About 6 minutes on 2 cores.
set -euo pipefail
OUT=${OUT:-runs/text_generation}
LICENSE=$(python -c "import os, sysconfig; print(os.path.join(sysconfig.get_paths()['stdlib'], 'LICENSE.txt'))")
[ -f "$OUT/pretrain/checkpoints/latest" ] || python -m megalm.train hydra.run.dir="$OUT/pretrain"
python -m megalm.evaluate "$OUT/pretrain" perplexity --data "$LICENSE"                # disjoint windows of 256
python -m megalm.evaluate "$OUT/pretrain" perplexity --data "$LICENSE" --stride 64    # each token sees >= 192
python examples/text_generation/make_cloze.py "$LICENSE" "$OUT/cloze.jsonl"
python -m megalm.evaluate "$OUT/pretrain" cloze --data "$OUT/cloze.jsonl"                # every token of the word
python -m megalm.evaluate "$OUT/pretrain" cloze --data "$OUT/cloze.jsonl" --non-strict   # its last token only
python -m megalm.generate "$OUT/pretrain" --prompt "def fibonacci(n):" --max-new-tokens 80 --temperature 0.8
