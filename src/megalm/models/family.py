"""The model-family registry: `model.arch` -> what a family declares about its models.

A family is a module under megalm.models that defines `FAMILY`, a Family. The registry names
the module and imports it on first use, so the list of families is known without importing
every model. Code outside a family's own files reaches its models
through `family_of(arch)`: how to build and initialise one, which parameters hold vocabulary
rows, which are tied, and its FLOPs per token.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from megalm.errors import ConfigError

FAMILY_MODULES: Dict[str, str] = {
    "gpt": "megalm.models.gpt",
    "bert": "megalm.models.bert",
    "t5": "megalm.models.t5",
}
"""model.arch -> the module defining its FAMILY; a new family adds its line here."""


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
    validate: Optional[Callable[..., None]] = None
    """(Config, world_size) -> None: the family's own config rules (ConfigErrors), after the shared ones."""
    tp_plan: Optional[Callable[..., Sequence[Tuple[str, Any]]]] = None
    """(ModelConfig, tp, sequence_parallel) -> [(module pattern, style)] of megalm.parallel.tp_plan;
    None: the family does not run tensor parallel."""
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
    corpus, as megalm.data.loader.GPTSamples); None: GPT's packed token sequences."""
    hf: Optional[str] = None
    """The module of its Hugging Face mapping (megalm.convert.hf says what it provides); None: no
    conversion."""
    vocab_params: Tuple[str, ...] = ()
    """Parameters whose rows are the padded vocabulary: a checkpoint stores the real rows only."""
    tied: Tuple[Tuple[str, str], ...] = ()
    """(copy, source) pairs shared when the config ties them (the head to the embedding)."""


def family_names() -> Tuple[str, ...]:
    return tuple(FAMILY_MODULES)


def family_of(arch: str) -> Family:
    """The registered family `arch` names; a ConfigError listing the families otherwise."""
    module = FAMILY_MODULES.get(arch)
    if module is None:
        raise ConfigError(f"model.arch={arch!r} is not a model family megalm has; choose one of "
                          f"{', '.join(family_names())}")
    family: Optional[Family] = getattr(importlib.import_module(module), "FAMILY", None)
    if not isinstance(family, Family) or family.name != arch:
        raise RuntimeError(f"{module} must define FAMILY = Family(name={arch!r}, ...)")  # a bug in the family
    return family
