"""The family contract: what a model family declares about its models, handed to the code that needs it.

A family (gpt, bert, t5, ...) is one folder under megalm.models holding its model, its parallel plans
(`parallelize.py`), its Hugging Face mapping and its declaration, a `Family`. The commands look the
family up once by `model.arch` (megalm.models.registry.family_of) and pass it down: `parallelize`, the
pipeline, ZeRO-3, recomputation, the trainer and checkpoints read what they need from the Family they
are given, never from a registry, and name no model class.

This module is the lowest layer besides megalm.errors: it imports nothing of megalm's, so models/,
parallel/ and training/ can all depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

KINDS = ("decoder", "encoder", "encoder-decoder")
"""What a family's models do with text, which decides what the commands offer them: a decoder generates
(generate, serve, evaluate's likelihood tasks, the harness), an encoder-decoder generates from a source,
an encoder scores (fine-tuned classification, QA)."""

Plan = Sequence[Tuple[str, Any]]
"""[(module pattern, style)]: a pattern names module paths, `*` standing for one dotted segment
(`blocks.*.attn.qkv`); a style (megalm.parallel) turns each matching module into its parallel form."""


@dataclass(frozen=True)
class Parts:
    """How a family's model divides into pipeline stages, ZeRO-3 units and recompute units.

    The model holds its layers in a ModuleDict keyed by global layer index (so parameter names
    are the same at every layout), modules that run before them on the first pipeline stage and
    after them on the last; a rank's model has the others set to None. Its forward takes
    `part=Part(...)` to run only those (a pipeline stage), and then returns what crosses to the
    next stage: a tensor, or a tuple of tensors, which the next stage's forward takes as its
    positional inputs.
    """
    layers: str = "blocks"
    first: Tuple[str, ...] = ()
    """Attributes of the model only the first stage holds (the embedding)."""
    last: Tuple[str, ...] = ()
    """Attributes only the last stage holds (final norm, output head, loss)."""
    selective: Tuple[str, ...] = ()
    """Parameter-free submodules of a layer that selective recomputation checkpoints (the attention core);
    each layer checkpoints those it has."""


@dataclass(frozen=True)
class Part:
    """The part of a model one forward runs: a pipeline stage's layers, and whether it is the first
    (takes the batch's inputs) or the last (returns the output / loss)."""
    layers: Sequence[int]
    first: bool
    last: bool


@dataclass(frozen=True)
class Family:
    name: str
    """The model.arch value that selects it."""
    config: type
    """Its model schema: a dataclass extending megalm.config.ModelConfig (registered as
    `model/<name>_schema`, which its presets name first in their defaults)."""
    build: Callable[..., Any]
    """(ModelConfig) -> the plain single-process model on the current default device, not
    initialised; vocabulary-sized layers padded for one process (the tp plan re-pads them)."""
    init_weights: Callable[..., None]
    """(model, ModelConfig, seed) -> None: fill every parameter from (seed, global name)."""
    flops_per_token: Callable[..., float]
    """(ModelConfig, seq_length or None) -> training FLOPs per token (megalm.models.flops)."""
    kind: str = "decoder"
    """One of KINDS: what the commands (generate, serve, evaluate, the planner) may do with it."""
    validate: Optional[Callable[..., None]] = None
    """(Config, world_size) -> None: the family's own config rules (ConfigErrors), after the shared ones."""
    tp_plan: Optional[Callable[..., Plan]] = None
    """(ModelConfig, tp, sequence_parallel) -> its tensor-parallel Plan (megalm.parallel.styles);
    None: the family does not run tensor parallel."""
    cp_plan: Optional[Callable[..., Plan]] = None
    """(ModelConfig) -> its context-parallel Plan (megalm.parallel.context's styles: the attention cores
    that attend around the ring, the modules whose positions follow the sequence's split); None: the
    family does not run context parallel."""
    expert_plan: Optional[Callable[..., Plan]] = None
    """(ModelConfig) -> the Plan of its mixture-of-experts layers
    (megalm.parallel.experts's styles: experts split over ep and expert tp, each rank routing its own
    tokens under tp and cp); None: no mixture of experts."""
    inputs: Tuple[str, ...] = ("tokens",)
    """The batch keys the model's forward takes, positionally and in this order (a pipeline's first
    stage gets them); the model's `loss(output, batch)` reads the batch's other keys."""
    optional_inputs: Tuple[str, ...] = ()
    """Batch keys the forward takes after `inputs` when a batch has them (GPT: position_ids and
    segment_ids of packed examples); all or none of them."""
    parts: Parts = Parts()
    """Its pipeline stages, ZeRO-3 units and recompute units."""
    samples: Optional[Callable[..., Any]] = None
    """(ModelConfig) -> how its training samples are made (megalm.data.build_data's `samples`: an
    object with split_by ("sequences" | "documents": what data.split divides), mock(tokenizer,
    seq_length, seed, split name, num_samples) -> a dataset, and dataset(indexed, documents range,
    tokenizer=, seq_length=, seed=, name=, num_samples=, cache_dir=) -> a dataset over a tokenized
    corpus, as megalm.data.samples.gpt.GPTSamples); None: GPT's packed token sequences."""
    hf: Optional[str] = None
    """The module of its Hugging Face mapping (megalm.convert.hf says what it provides); None: no
    conversion."""
    vocab_params: Tuple[str, ...] = ()
    """Parameters whose rows are the padded vocabulary: a checkpoint stores the real rows only."""
    tied: Tuple[Tuple[str, str], ...] = ()
    """(copy, source) pairs shared when the config ties them (the head to the embedding)."""

    def __post_init__(self):
        if self.kind not in KINDS:  # a bug in the family's declaration, not a user's error
            raise ValueError(f"Family {self.name!r}: kind={self.kind!r} is not one of {', '.join(KINDS)}")
