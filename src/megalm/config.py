"""Typed config schemas (megalm.models.registry registers them with Hydra).

Every field is typed and carries a default (or MISSING) and a one-line doc. The YAML files
under conf/ are merged into these dataclasses by Hydra, so a misspelt key or a value of the
wrong type fails at composition time; megalm.validation checks the rules that span fields.
Nothing rewrites a value the user wrote: derived values are properties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """The transformer fields every model family shares. A family's own schema extends it (GPT's:
    megalm.models.gpt.config.GPTConfig) and a model preset names its schema first in its defaults
    (`- gpt_schema`), so a preset accepts exactly its family's fields."""
    name: str = MISSING
    """Preset name, for logs and run directories."""
    arch: str = MISSING
    """Model family (megalm.models.registry): set by the family's schema."""
    num_layers: int = MISSING
    """Number of Transformer blocks."""
    hidden_size: int = MISSING
    """Width of the residual stream."""
    num_attention_heads: int = MISSING
    """Query heads per attention layer."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None = num_attention_heads (plain MHA)."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None = 4 * hidden_size (gelu, gelu_exact) or the Llama rule 2/3 * 4h rounded up to 256 (swiglu)."""
    seq_length: int = MISSING
    """Tokens per training sample."""
    vocab_size: int = MISSING
    """Tokenizer vocabulary size; the embedding is padded up to make_vocab_size_divisible_by."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding rows to a multiple of this (Megatron's default 128), for fast matmuls."""
    normalization: str = "layernorm"
    """layernorm | rmsnorm."""
    norm_eps: float = 1e-5
    """Epsilon of the normalization layers."""
    activation: str = "gelu"
    """gelu (tanh approximation: GPT-2's) | gelu_exact (erf: BERT's, Megatron's default) | relu | swiglu."""
    bias: bool = True
    """Biases in linear layers and LayerNorm (GPT-2/3: true, Llama: false)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention-out and MLP-out (the hidden dropout)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Std of the normal initialisation; output projections use init_std / sqrt(2 * num_layers)."""
    transformer_impl: str = "local"
    """local | te (Transformer Engine, GPU only)."""
    attention_backend: str = "auto"
    """auto | sdpa | unfused: the attention kernel. sdpa: torch's scaled_dot_product_attention (flash
    kernels); unfused: separate matmuls, mask and fp32 softmax (Megatron's unfused attention), which a
    compiled graph fuses; auto: unfused inside a compiled graph on CPU in bf16 / fp16, where it was measured
    faster, sdpa elsewhere. The same weights and results either way; context parallelism's ring attention
    has its own kernel."""

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 256 * math.ceil(int(8 * self.hidden_size / 3) / 256)
        return 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows in one process; see padded_vocab."""
        return self.padded_vocab(1)

    def padded_vocab(self, tp: int) -> int:
        """Embedding rows at tensor-parallel degree tp: a multiple of make_vocab_size_divisible_by x tp
        (Megatron's rule, so every shard is the same size). Checkpoints keep only the real rows."""
        m = self.make_vocab_size_divisible_by * tp
        return m * math.ceil(self.vocab_size / m)


@dataclass
class ParallelConfig:
    name: str = "single"
    """Preset name of the layout."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp: int = -1
    """Data-parallel degree; -1 = world size / (tp * pp * cp)."""
    ep: int = 1
    """Expert-parallel degree: each mixture-of-experts layer's experts split over ep of the dp ranks (ep divides
    dp), tokens sent to their experts' ranks and back by all-to-all (megalm.parallel.experts)."""
    expert_tp: int = 1
    """Tensor parallelism of the experts: 1 keeps every expert whole on each tp rank (which routes and computes its
    own share of the tokens); parallel.tp splits each expert's fc1 columns and fc2 rows over the tp ranks, which run
    one another's routed tokens through their shards (Megatron-Core's expert tensor parallelism)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (two chunks a rank, for causal balance), attention
    passing keys and values around the ring (megalm.parallel.context); GPT-family language models."""
    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence inside the tp group (needs tp > 1)."""
    pipeline_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved_1f1b | interleaved_zb (zero bubble) | zbv (zero bubble, V-shaped)."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline rank (interleaved schedules: >= 2; zbv: 2)."""
    layers_per_stage: Optional[List[int]] = None
    """Layers of each (virtual) stage in order, for uneven splits; None = even."""
    zero_stage: int = 0
    """0 = plain DP, 1 = shard optimizer state over dp, 2 = + gradients, 3 = + parameters (gathered per layer)."""
    bucket_size_mb: Optional[float] = None
    """fp32 gradient MiB per data-parallel bucket (one collective each, launched during backward); None: Megatron's
    size by parameter count, max(40M, 1M x dp) parameters a bucket (160 MB of fp32 gradient and up)."""
    overlap_param_gather: bool = False
    """ZeRO 1/2: the parameter all-gather after the update runs in the background, each bucket waited on when the
    next forward first uses one of its weights (Megatron's --overlap-param-gather); false: waited on at once."""
    tp_comm_overlap: bool = False
    """Under sequence parallelism, hide tensor parallelism's collectives behind matmuls (Megatron's
    --tp-comm-overlap): the all-gather before each column-parallel linear and the reduce-scatter after each
    row-parallel one are cut into tp pieces along the sequence, each piece's matmul running while the next
    piece moves; in backward the input's gather runs beside the input-gradient matmul and its gradient's
    reduce-scatter beside the weight-gradient one. The same values up to the rounding of a matmul over fewer
    rows; false: every collective waited on between the matmuls."""
    recompute: str = "none"
    """none | selective (attention core) | full (whole blocks) activation recomputation."""
    recompute_num_layers: Optional[int] = None
    """With recompute=full: recompute the first N blocks of each stage; None = every block."""
    recompute_activation: bool = False
    """Free each dense MLP's activation output (fc2's input) after fc2's forward and compute it again from fc1's
    output (kept anyway by the activation's backward) when backward reaches fc2; with recompute none or selective
    (GELU, SwiGLU: f a token less in the compute dtype; ReLU keeps its output for its own backward: no change)."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """adamw | sgd."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms, biases or other 1-D parameters."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr over this many steps."""
    decay: str = "cosine"
    """cosine | linear | constant (after warmup)."""
    decay_steps: Optional[int] = None
    """Step at which decay reaches min_lr; None = trainer.max_steps."""
    implementation: str = "fused"
    """fused | foreach | for_loop: torch.optim's kernel for the update. fused (one kernel over all tensors,
    on CPU and CUDA) is the fastest; the three compute the same update up to rounding."""


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    """Optimizer steps to train; the LR schedule and the data order are planned for this many."""
    epochs: Optional[int] = None
    """Fine-tuning (data.source sft, classification, qa): passes over the training examples, which set
    max_steps = ceil(epochs x training samples / global_batch_size); None: max_steps decides."""
    exit_interval: Optional[int] = None
    """Save a checkpoint and stop when the step is a multiple of this (a later start resumes); None = never."""
    micro_batch_size: int = 8
    """Samples per forward/backward on each data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step = micro_batch_size * grad-accumulation steps * dp."""
    eval_interval: int = 100
    """Evaluate every this many steps (0 = only at the start and the end)."""
    eval_steps: int = 10
    """Global batches of validation data per evaluation (the same samples every time)."""
    eval_at_start: bool = True
    """Evaluate before the first step, so the log shows where the loss started."""
    monitor: str = "val_loss"
    """The validation number checkpoint.save_best and early stopping watch: val_loss, val_ppl (language models), or
    val_NAME for a number the model reports (val_acc, val_start_acc, val_mlm_acc, ...: train.log's validation lines)."""
    monitor_mode: str = "auto"
    """Which way trainer.monitor improves: min | max | auto (min for val_loss and val_ppl, max for the rest)."""
    early_stopping_patience: int = 0
    """Stop (saving a checkpoint) after this many evaluations in a row that do not improve trainer.monitor by more
    than early_stopping_min_delta; 0 = never (the default)."""
    early_stopping_min_delta: float = 0.0
    """The least change of trainer.monitor that counts as an improvement."""
    log_interval: int = 10
    """Write metrics every this many steps."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16 (low-precision compute, by trainer.mixed_precision) | fp8 (Transformer Engine)."""
    mixed_precision: str = "autocast"
    """How bf16 / fp16 train (no effect in fp32): autocast (fp32 weights, gradients and optimizer; every op casts
    the weights it uses) | main_params (Megatron's: weights held in bf16 / fp16, fp32 main parameters in the
    optimizer, sharded under ZeRO, gradients accumulated into fp32 main-grad buffers)."""
    loss_scale: Optional[float] = None
    """fp16 only: a fixed loss scale; None = dynamic scaling."""
    initial_loss_scale: float = 4294967296.0
    """fp16 dynamic scaling: starting scale (2^32, as Megatron)."""
    loss_scale_window: int = 1000
    """fp16 dynamic scaling: clean steps before the scale doubles."""
    hysteresis: int = 2
    """fp16 dynamic scaling: overflowing steps tolerated before the scale halves."""
    min_loss_scale: float = 1.0
    """fp16 dynamic scaling: the scale never drops below this."""
    max_consecutive_skips: int = 50
    """fp16: stop the run after this many overflowing (skipped) steps in a row; 0 = never. From 2^32 the scale
    reaches 1 after hysteresis - 1 + 32 skips, so 50 stops only a run that cannot recover."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    device: str = "auto"
    """auto (cuda if present, else cpu) | cpu | cuda."""
    num_threads: int = 0
    """torch intra-op threads per rank on CPU; 0 = $OMP_NUM_THREADS when it is set, else cores / local ranks."""
    cpu_allocator: str = "reuse"
    """On CPU, what malloc does with the large blocks a step frees: reuse (kept in the process for the next step, no
    fresh pages to fault in: 1.16x tokens/s on the default run, for a higher resident peak; docs/PERFORMANCE.md;
    glibc only) | system (the C library's defaults, MALLOC_* environment variables included)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0 (on the console, below the log); the log (train.log, and the console) gets a
    line every log_interval either way."""
    time_breakdown: bool = True
    """Log where each step's time goes (data, forward, backward, optimizer, collectives, pipeline idle) as time_*_s
    at log_interval; under 1% of a CPU step (docs/PERFORMANCE.md); on CUDA it synchronizes the device at each phase."""
    compile: str = "none"
    """torch.compile: none | model (the whole forward of the rank: the model, or each pipeline stage) | blocks (each
    transformer block on its own). Off by default: compiling costs time at the first step (docs/PERFORMANCE.md)."""
    compile_backend: str = "inductor"
    """torch.compile backend with trainer.compile on: inductor (generated kernels; on CPU it needs a C++ compiler,
    else the run goes on eagerly with a warning) | aot_eager (graph capture without code generation: checks) | eager
    (dynamo's capture alone)."""
    profile_steps: List[int] = field(default_factory=list)
    """Steps (1 = the first) to run under torch.profiler, each rank writing
    <run dir>/profiles/step_NNNNNNNN_rankR.pt.trace.json (the step zero-padded to 8 digits)."""


@dataclass
class TokenizerConfig:
    type: str = "sentencepiece"
    """sentencepiece | huggingface (a tokenizer.json, needs megalm[hf]) | null (pre-tokenized: ids are used as they are)."""
    model: Optional[str] = None
    """A sentencepiece .model, or a Hugging Face tokenizer.json (or its folder); None = train a sentencepiece model on the corpus."""
    vocab_size: int = 8192
    """Vocabulary when training a tokenizer, or the id range of the null tokenizer."""
    eod_token: Optional[str] = None
    """huggingface: the end-of-document token; None = the first of <|endoftext|>, </s>, <|end_of_text|>, <eos>, <|im_end|>, [SEP] it has."""
    add_special_tokens: bool = False
    """huggingface: apply the tokenizer.json post-processor to each document (e.g. Llama's <s> in front)."""
    special_tokens: List[str] = field(default_factory=list)
    """Tokens the tokenizer must have (BERT: [CLS], [SEP], [MASK], [PAD]); a sentencepiece model megalm trains reserves them."""


@dataclass
class DataConfig:
    name: str = "stdlib"
    """Preset name."""
    source: str = "stdlib"
    """stdlib (Python's sources, the default) | stdlib_prose (docstrings as sentences, for BERT) | mock | indexed | sft
    | classification (labelled examples, or multiple choice) | qa (SQuAD, extractive)."""
    paths: List[str] = field(default_factory=list)
    """One .bin/.idx prefix (source=indexed; Megatron's flat weighted form [w, prefix, ...] also works); example files
    (sft, classification, qa; RACE: directories of its .txt files)."""
    blend: List[Any] = field(default_factory=list)
    """Weighted .bin/.idx prefixes (source=indexed): [[0.3, prefix_a], [0.7, prefix_b]] or flat [0.3, prefix_a, 0.7, prefix_b]."""
    split: str = "98,2,0"
    """Train, validation, test weights over documents."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """How text becomes token ids."""
    cache_dir: str = "~/.cache/megalm"
    """Where tokenizers, tokenized corpora and sample indices are cached."""
    max_corpus_mb: float = 0.0
    """Use at most this many MB of the stdlib corpus (0 = all of it)."""
    eod_mask_loss: bool = False
    """Zero the loss at positions whose input token is end-of-document (Megatron's --eod-mask-loss)."""
    valid_paths: List[str] = field(default_factory=list)
    """classification, qa: validation files (empty: data.split divides data.paths)."""
    task: str = "jsonl"
    """classification: the files' layout: jsonl ({text, text_pair?, label}) | fasttext (`__label__NAME text` lines) |
    mnli | qqp | sst2 | cola | stsb (GLUE's TSV); multiple choice (model.num_choices): choice ({context, choices,
    label}) | race (RACE's JSON .txt files)."""
    labels: List[str] = field(default_factory=list)
    """classification, task=jsonl or fasttext: the class names in label order (jsonl: empty for integer labels, or a
    regression; fasttext needs them)."""
    doc_stride: int = 128
    """qa: tokens between the starts of the windows a long context is read in (BERT's run_squad)."""
    max_query_length: int = 64
    """qa: the question's tokens kept (the rest are cut)."""
    packing: bool = False
    """sft: pack whole examples into each sequence, positions and attention reset per example (false: one, padded)."""
    chat_template: str = "{role}: {content}\n"
    """sft: how each chat message is written; the loss is on assistant messages' {content} and what follows it."""
    pair_suffixes: List[str] = field(default_factory=list)
    """sft: [] reads data.paths as JSON lines; [S, T] (e.g. [en, fr]) reads each data.paths entry PREFIX as the
    line-aligned text files PREFIX.S (sources) and PREFIX.T (targets) of a translation corpus, line k a pair (a
    decoder model sees it as a user's source and an assistant's target, through data.chat_template)."""
    check_vocab: bool = True
    """Scan each .bin once (result cached) for token ids outside the tokenizer's vocabulary."""
    prefetch: int = 2
    """Global batches prepared ahead in a background thread while the step computes (on CUDA in pinned memory, copied
    to the device without blocking); 0: each step builds its batch itself."""


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    """Checkpoint folder, relative to the run directory unless absolute."""
    interval: int = 0
    """Save every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (0 = keep all)."""
    load: Optional[str] = None
    """Start from this checkpoint (a step folder, a checkpoint dir, or a run directory: its latest); None =
    auto-resume from the run directory."""
    finetune: bool = False
    """With `load`: take the weights only (a fresh optimizer, step 0, data from the start), to fine-tune."""
    save: bool = True
    """Write checkpoints at all."""
    async_save: bool = False
    """Write checkpoints from a background thread (state copied to CPU first) while training goes on (default false)."""
    save_best: bool = False
    """Also save at each evaluation that is the best so far by trainer.monitor, and keep that checkpoint (`best` in
    the checkpoint folder names it): evaluate, generate and serve then read it instead of the latest (default false)."""


@dataclass
class ClusterConfig:
    name: str = "local"
    """Preset name."""
    launcher: str = "local"
    """local (this machine) | torchrun | slurm."""
    nodes: int = 1
    """Number of machines."""
    devices_per_node: int = 8
    """GPUs per node, or the most CPU ranks to spawn per node on a CPU profile."""
    backend: str = "auto"
    """auto (nccl on GPUs, gloo on CPU) | nccl | gloo."""
    peak_flops: Optional[float] = None
    """Peak dense FLOP/s of one device for MFU, whatever the precision; None = peak_flops_per_dtype."""
    peak_flops_per_dtype: Dict[str, float] = field(default_factory=dict)
    """Peak dense FLOP/s of one device per trainer.precision (fp32, bf16, fp16, fp8); a precision missing
    here (and no peak_flops) is measured: a matmul in that precision at start-up."""
    max_restarts: int = 0
    """Restarts the elastic launcher allows after a rank fails."""
    # What megalm.plan needs to estimate step time and memory fit (not read by training). None = unknown:
    # the planner then leaves out what depends on it and says so.
    memory_per_device_gb: Optional[float] = None
    """Memory of one device in GB (1e9 bytes), for the planner's fit check."""
    memory_bandwidth: Optional[float] = None
    """Device memory bandwidth in bytes/s (the optimizer step is bound by it)."""
    intra_node_bandwidth: Optional[float] = None
    """Bytes/s one device sends to another in its node, one direction (NVLink)."""
    inter_node_bandwidth: Optional[float] = None
    """Bytes/s one device sends across nodes, one direction (its share of the node's network)."""
    intra_node_latency: float = 5e-6
    """Seconds one message takes inside a node before its bytes count (alpha of the alpha-beta model)."""
    inter_node_latency: float = 1e-5
    """Seconds one message takes between nodes before its bytes count."""
    matmul_efficiency: float = 0.7
    """Share of the peak FLOP/s that a step's matmuls reach, for the planner's compute time."""
    comm_efficiency: float = 0.8
    """Share of the link bandwidth that collectives reach (NCCL's bus bandwidth over the link's)."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """online | offline | disabled."""
    project: str = "megalm"
    """wandb project name."""
    entity: Optional[str] = None
    """wandb team or user; None = your default."""


@dataclass
class LoggingConfig:
    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    tensorboard: bool = False
    """Write TensorBoard events (needs the tensorboard package)."""
    curves: bool = True
    """Draw metrics.jsonl's curves (loss, validation loss, learning rate, tokens/s) to curves.png in the
    run directory when the run ends (megalm.report; needs logging.jsonl)."""
    title: Optional[str] = None
    """What curves.png's title says after the model's name; None = the overrides the run was started with on the
    command line (a sweep's job: its own), or for a run started from Python its layout, precision, batch, learning
    rate and steps."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging."""


@dataclass
class Config:
    model: ModelConfig = MISSING
    parallel: ParallelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    data: DataConfig = MISSING
    cluster: ClusterConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: Optional[str] = None
    """Run directory; None = the directory Hydra made for this job."""


def conf_dir() -> str:
    """The conf/ tree: inside the installed package (wheel), else the source checkout's top level."""
    from pathlib import Path
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parents[1] / "conf"):
        if (candidate / "config.yaml").exists():
            return str(candidate)
    raise FileNotFoundError(f"megalm's conf/ tree is neither in {here} nor in {here.parents[1]}")
