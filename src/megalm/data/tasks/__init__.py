"""Fine-tuning data: examples read from files, made into samples by a model family.

- sft: prompt / response and chat examples (data=sft), with packing;
- classification: GLUE's layouts, JSON lines, fastText lines and multiple choice (data=classification);
- squad: SQuAD questions and their context windows (data=qa).
"""
