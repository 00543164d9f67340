"""Training samples, per model family, with megatron-core's semantics (sample for sample).

- gpt: packed token sequences over shuffled documents (GPTSamples: GPT's way of making samples);
- bert, t5: masked-LM and span-corruption samples over sentence-split corpora (BertSamples, T5Samples),
  with what they share in masking;
- sentence_index: BERT's and T5's sample index (megatron-core's build_mapping, in numpy);
- blended: Megatron's weighted blend of several datasets.
"""
