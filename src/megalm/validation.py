"""Cross-field validation of a composed Config: pure arithmetic, before anything is allocated.

Every error is a ConfigError (a ValueError) that names the values and what is allowed. Nothing
here rewrites what the user wrote.
"""

from __future__ import annotations

from typing import Any

from megalm.config import Config, ModelConfig, ParallelConfig
from megalm.data.spec import blend_spec, split_weights
from megalm.data.tasks.classification import CHOICE_TASKS, num_classes
from megalm.data.tasks.sft import template_parts
from megalm.distributed.mesh import ParallelDims
from megalm.errors import ConfigError, did_you_mean
from megalm.family import Family
from megalm.launch import detect_rank_env
from megalm.models.registry import family_names, family_of
from megalm.ops.fused_loss import BACKWARDS as FUSED_LOSS_BACKWARDS
from megalm.parallel import te_available
from megalm.parallel.stages import MULTI_STAGE, stage_layer_ranges
from megalm.training.cpu_memory import CHOICES as ALLOCATORS


CHOICES = {
    "model.normalization": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "gelu_exact", "relu", "swiglu"),
    "model.transformer_impl": ("local", "te"),
    "model.attention_backend": ("auto", "sdpa", "unfused"),
    "model.fused_loss_backward": FUSED_LOSS_BACKWARDS,
    "parallel.pipeline_schedule": ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"),
    "parallel.recompute": ("none", "selective", "full"),
    "optimizer.name": ("adamw", "sgd"),
    "optimizer.decay": ("cosine", "linear", "constant"),
    "optimizer.implementation": ("fused", "foreach", "for_loop"),
    "trainer.precision": ("fp32", "bf16", "fp16", "fp8"),
    "trainer.mixed_precision": ("autocast", "main_params"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.compile": ("none", "model", "blocks"),
    "trainer.monitor_mode": ("auto", "min", "max"),
    "trainer.cpu_allocator": ALLOCATORS,
    "trainer.compile_backend": ("inductor", "aot_eager", "eager"),
    "data.source": ("stdlib", "stdlib_prose", "mock", "indexed", "sft", "classification", "qa"),
    "data.tokenizer.type": ("sentencepiece", "huggingface", "null"),
    "cluster.launcher": ("local", "torchrun", "slurm"),
    "cluster.backend": ("auto", "nccl", "gloo"),
    "logging.wandb.mode": ("online", "offline", "disabled"),
}


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: Config, world_size: int, launching: bool = False) -> None:
    """Check cross-field rules; raise ConfigError naming the values and what is allowed.

    `launching`: the run starts here (megalm.train), so what this machine cannot run is refused too (the
    process group's backend); megalm.plan, which only models a cluster, leaves it off."""
    for key, allowed in {"model.arch": family_names(), **CHOICES}.items():  # families as registered now
        if key.startswith("model.") and not hasattr(cfg.model, key[6:]):
            continue  # a field of another family's schema
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{did_you_mean(str(value), allowed)}")
    m, p, o, t = cfg.model, cfg.parallel, cfg.optimizer, cfg.trainer
    family = family_of(m.arch)
    if not isinstance(m, family.config):
        raise ConfigError(f"model.arch={m.arch!r} but the model preset {m.name!r} is a {type(m).__name__}, not the "
                          f"{family.config.__name__} of the {m.arch} family: choose a {m.arch} preset (model=...)")

    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads, "model.seq_length": m.seq_length,
        "model.vocab_size": m.vocab_size, "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp,
        "parallel.virtual_pipeline_size": p.virtual_pipeline_size,
        "trainer.max_steps": t.max_steps, "trainer.micro_batch_size": t.micro_batch_size,
        "trainer.global_batch_size": t.global_batch_size,
        "cluster.nodes": cfg.cluster.nodes, "cluster.devices_per_node": cfg.cluster.devices_per_node,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    optional_positive = {  # null: derived
        "model.num_query_groups": (m.num_query_groups, "num_attention_heads, plain multi-head attention"),
        "model.ffn_hidden_size": (m.ffn_hidden_size, "derived from hidden_size and the activation"),
    }
    for key, (value, null) in optional_positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1 (or null: {null})")
    for key, value in (("optimizer.eps", o.eps), ("model.init_std", m.init_std), ("model.norm_eps", m.norm_eps)):
        if not value > 0:
            raise ConfigError(f"{key}={value} must be positive")
    non_negative = {
        "optimizer.lr": o.lr, "optimizer.min_lr": o.min_lr, "optimizer.weight_decay": o.weight_decay,
        "optimizer.warmup_steps": o.warmup_steps, "trainer.eval_interval": t.eval_interval,
        "trainer.eval_steps": t.eval_steps, "trainer.grad_clip": t.grad_clip,
        "trainer.num_threads": t.num_threads, "checkpoint.interval": cfg.checkpoint.interval,
        "checkpoint.keep_last": cfg.checkpoint.keep_last, "cluster.max_restarts": cfg.cluster.max_restarts,
        "data.max_corpus_mb": cfg.data.max_corpus_mb, "trainer.max_consecutive_skips": t.max_consecutive_skips,
        "trainer.early_stopping_patience": t.early_stopping_patience,
        "trainer.early_stopping_min_delta": t.early_stopping_min_delta, "data.prefetch": cfg.data.prefetch,
        "optimizer.momentum": o.momentum,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    if o.lr == 0:
        raise ConfigError("optimizer.lr=0 would never change the weights; use a positive learning rate")
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}")
    if o.decay_steps is not None and o.decay_steps < max(1, o.warmup_steps):
        raise ConfigError(f"optimizer.decay_steps={o.decay_steps} is the step the decay reaches min_lr at: it must be "
                          f"at least 1 and at least optimizer.warmup_steps={o.warmup_steps} (or null: trainer.max_steps)")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"trainer.seed={t.seed} must be in [0, 2**32) (numpy RandomState draws the data order "
                          "from it)")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas={list(o.betas)} must be two numbers in [0, 1)")
    if t.log_interval < 1:
        raise ConfigError(f"trainer.log_interval={t.log_interval} must be at least 1")
    for key in ("model.dropout", "model.attention_dropout"):
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be in [0, 1)")
    if hasattr(m, "fused_loss"):
        _validate_fused_loss(m)

    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_query_groups={m.kv_heads}")
    if m.transformer_impl == "te":
        if not te_available():
            raise ConfigError(
                "model.transformer_impl=te needs Transformer Engine on a CUDA device "
                "(pip install 'megalm[te]'); use model.transformer_impl=local")
        raise ConfigError("model.transformer_impl=te is not wired into the model yet; use local")

    if family.validate is not None:
        family.validate(cfg, world_size)
    dims = parallel_dims(p, world_size)  # raises on a layout that does not fit the world
    for key, degree in (("model.num_attention_heads", m.num_attention_heads),
                        ("model.num_query_groups", m.kv_heads),  # hidden = heads x head_dim follows
                        ("model.ffn_size", m.ffn_size)):
        if degree % p.tp:
            raise ConfigError(f"{key}={degree} is not divisible by parallel.tp={p.tp}")
    c = cfg.cluster
    if (c.backend == "nccl" or c.launcher != "local") and p.tp > c.devices_per_node:
        raise ConfigError(f"parallel.tp={p.tp} is larger than cluster.devices_per_node={c.devices_per_node} "
                          f"(cluster={c.name}): a tensor-parallel group must stay inside one node")
    if p.tp > 1 and family.tp_plan is None:
        raise ConfigError(f"parallel.tp={p.tp}: the {m.arch} family has no tensor-parallel plan; use parallel.tp=1")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (tp=1)")
    per_step = t.micro_batch_size * dims.dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size({t.micro_batch_size}) * dp({dims.dp}) = {per_step}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} is not one of 0, 1, 2, 3")
    if p.overlap_param_gather and p.zero_stage not in (1, 2):
        raise ConfigError(f"parallel.overlap_param_gather=true overlaps ZeRO 1/2's parameter all-gather; "
                          f"parallel.zero_stage={p.zero_stage} has " + ("none" if p.zero_stage == 0 else
                          "its own (ZeRO-3 prefetches each layer's gather during the previous one)") +
                          ": set parallel.zero_stage=1 or 2, or parallel.overlap_param_gather=false")
    # Not built yet: refuse clearly rather than silently run something else.
    if t.precision == "fp8":
        raise ConfigError("trainer.precision=fp8 runs through Transformer Engine (model.transformer_impl=te), "
                          "which is not wired in yet; use fp32, bf16 or fp16")
    for key, value in (("trainer.initial_loss_scale", t.initial_loss_scale), ("trainer.min_loss_scale", t.min_loss_scale),
                       ("trainer.loss_scale_window", t.loss_scale_window), ("trainer.hysteresis", t.hysteresis),
                       ("trainer.loss_scale", t.loss_scale if t.loss_scale is not None else 1.0)):
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if t.loss_scale is not None and t.precision != "fp16":
        raise ConfigError(f"trainer.loss_scale={t.loss_scale} applies to fp16 only (trainer.precision={t.precision}): "
                          "set trainer.precision=fp16 or trainer.loss_scale=null")
    if cfg.checkpoint.finetune and not cfg.checkpoint.load:
        raise ConfigError("checkpoint.finetune=true takes the weights of checkpoint.load, which is not set")
    if cfg.checkpoint.async_save and not cfg.checkpoint.save:
        raise ConfigError("checkpoint.async_save=true writes checkpoints in the background, but checkpoint.save=false "
                          "writes none; set checkpoint.save=true or drop async_save")
    if p.pp > 1:
        _validate_pipeline(p, m, per_step=t.micro_batch_size * dims.dp, global_batch=t.global_batch_size)
    elif p.virtual_pipeline_size != 1 or p.layers_per_stage:
        raise ConfigError(f"parallel.virtual_pipeline_size={p.virtual_pipeline_size} / layers_per_stage="
                          f"{p.layers_per_stage} need pipeline parallelism (parallel.pp={p.pp})")
    if p.sequence_parallel and m.seq_length % (p.tp * p.cp):
        raise ConfigError(f"parallel.sequence_parallel=true splits model.seq_length={m.seq_length} over "
                          f"parallel.tp={p.tp}" + (f" (on each cp rank's {p.cp}th of it)" if p.cp > 1 else "")
                          + ", which does not divide it")
    if p.cp > 1:
        _validate_context(cfg, family)
    _validate_experts(cfg, dims.dp)
    if p.bucket_size_mb is not None and not p.bucket_size_mb > 0:
        raise ConfigError(f"parallel.bucket_size_mb={p.bucket_size_mb} must be positive, or null for Megatron's "
                          f"max(40M, 1M x dp) parameters a bucket")
    if p.tp_comm_overlap and not (p.tp > 1 and p.sequence_parallel):
        raise ConfigError(f"parallel.tp_comm_overlap=true overlaps sequence parallelism's all-gathers and "
                          f"reduce-scatters with the matmuls beside them; with parallel.tp={p.tp} and "
                          f"parallel.sequence_parallel={str(p.sequence_parallel).lower()} there are none: set "
                          f"parallel.sequence_parallel=true with tp > 1, or parallel.tp_comm_overlap=false")
    if p.tp_comm_overlap and t.compile != "none":
        raise ConfigError(f"parallel.tp_comm_overlap=true runs its pieces eagerly, and trainer.compile="
                          f"{t.compile} traces the layers into graphs with their collectives whole: set "
                          f"trainer.compile=none or parallel.tp_comm_overlap=false")
    if p.recompute_activation and (p.recompute == "full" or getattr(m, "num_experts", 0)):
        raise ConfigError("parallel.recompute_activation=true recomputes a dense MLP's activation; "
                          + ("with parallel.recompute=full the whole layer is recomputed already"
                             if p.recompute == "full" else f"model.num_experts={m.num_experts}: the experts' "
                             "activation is not covered")
                          + ": set parallel.recompute_activation=false")
    if p.recompute_num_layers is not None and (p.recompute != "full" or p.recompute_num_layers < 1):
        raise ConfigError(f"parallel.recompute_num_layers={p.recompute_num_layers} needs recompute=full "
                          f"(got {p.recompute}) and a value of at least 1")
    if p.recompute_num_layers is not None:
        stages = p.pp * p.virtual_pipeline_size
        most = max(len(r) for r in stage_layer_ranges(m.num_layers, stages, p.layers_per_stage))
        if p.recompute_num_layers > most:
            raise ConfigError(f"parallel.recompute_num_layers={p.recompute_num_layers} recomputes the first N blocks "
                              f"of each pipeline stage, but a stage holds at most {most} (model.num_layers="
                              f"{m.num_layers} over {stages} stage(s)): use at most {most}, or null for every block")
    if cfg.data.source == "indexed":
        if not cfg.data.paths and not cfg.data.blend:
            raise ConfigError("data.source=indexed needs data.paths (a .bin/.idx prefix) or data.blend "
                              "(weighted prefixes: [[0.3, prefix_a], [0.7, prefix_b]])")
        blend_spec(cfg.data)  # weights and form checked here, before anything is built
    if cfg.data.source in ("classification", "qa") and not cfg.data.paths:
        raise ConfigError(f"data.source={cfg.data.source} reads labelled examples: set data.paths=[train file, ...] "
                          "(and data.valid_paths" + (", data.task)" if cfg.data.source == "classification" else ")"))
    _validate_head(cfg)
    _validate_epochs(cfg)
    if cfg.data.source == "sft":
        if not cfg.data.paths or cfg.data.blend:
            raise ConfigError("data.source=sft reads JSON-lines files of examples: set data.paths=[train.jsonl, ...] "
                              "(data.blend is for .bin/.idx corpora)")
        if cfg.data.tokenizer.type != "null" and not cfg.data.tokenizer.model:
            raise ConfigError("data.source=sft needs the tokenizer the model was trained with: set "
                              "data.tokenizer.model (e.g. <pretraining run>/tokenizer.model)")
        template_parts(cfg.data.chat_template, "user")
    _validate_vocab(cfg)
    for precision, peak in cfg.cluster.peak_flops_per_dtype.items():
        if precision not in CHOICES["trainer.precision"] or not peak > 0:
            raise ConfigError(f"cluster.peak_flops_per_dtype.{precision}={peak}: keys are "
                              f"{', '.join(CHOICES['trainer.precision'])}, values positive FLOP/s")
    c = cfg.cluster
    for key in ("peak_flops", "memory_per_device_gb", "memory_bandwidth", "intra_node_bandwidth",
                "inter_node_bandwidth"):
        value = getattr(c, key)
        if value is not None and not value > 0:
            raise ConfigError(f"cluster.{key}={value} must be positive (or null: unknown)")
    for key in ("intra_node_latency", "inter_node_latency"):
        if not getattr(c, key) >= 0:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must not be negative (seconds)")
    for key in ("matmul_efficiency", "comm_efficiency"):
        if not 0 < getattr(c, key) <= 1:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be in (0, 1]: a share of the peak")
    _validate_backend(cfg, world_size, launching)
    if t.exit_interval is not None and t.exit_interval < 1:
        raise ConfigError(f"trainer.exit_interval={t.exit_interval} must be at least 1 (or null)")
    _validate_profile_steps(t)
    watching = [k for k, on in (("checkpoint.save_best=true", cfg.checkpoint.save_best),
                                (f"trainer.early_stopping_patience={t.early_stopping_patience}",
                                 t.early_stopping_patience > 0)) if on]
    if watching and t.eval_steps == 0:
        raise ConfigError(f"{' and '.join(watching)} watch trainer.monitor={t.monitor} at each evaluation, but "
                          "trainer.eval_steps=0 evaluates never: give eval_steps at least 1")
    if cfg.checkpoint.save_best and not cfg.checkpoint.save:
        raise ConfigError("checkpoint.save_best=true keeps the best checkpoint, but checkpoint.save=false writes none")
    split_weights(cfg.data.split)


def _validate_backend(cfg: Config, world_size: int, launching: bool) -> None:
    """cluster.backend=nccl joins the ranks' process group (more than one rank, or any a launcher started) over
    CUDA devices only; auto picks gloo on CPU. Launching, trainer.device=auto is what it resolves to here."""
    c, device = cfg.cluster, cfg.trainer.device
    if c.backend != "nccl":
        return
    on_cpu = device == "cpu"
    if launching:
        import torch.distributed
        if world_size == 1 and detect_rank_env() is None:
            return  # one process: no process group
        on_cpu = on_cpu or (device == "auto" and not torch.cuda.is_available())
    elif world_size == 1:
        return
    if on_cpu:
        why = " (no CUDA device is visible)" if device == "auto" else ""
        raise ConfigError(f"cluster.backend=nccl (cluster={c.name}) runs on CUDA devices, but trainer.device="
                          f"{device} puts this run's {world_size} rank(s) on the CPU{why}: use cluster.backend=auto "
                          "or gloo on CPU")
    if launching and not torch.distributed.is_nccl_available():
        raise ConfigError(f"cluster.backend=nccl (cluster={c.name}) but this torch has no NCCL "
                          "(torch.distributed.is_nccl_available() is false): use cluster.backend=auto or gloo")


def _validate_profile_steps(t) -> None:
    """Steps to profile are training steps: whole numbers from 1 (the first) to max_steps (with
    trainer.epochs, max_steps is known only once the data is read, so the upper end is not checked)."""
    top = f"trainer.max_steps={t.max_steps}" if t.epochs is None else "the last step"
    for step in t.profile_steps:
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"trainer.profile_steps={list(t.profile_steps)}: {step!r} is not a step number; "
                              f"list whole numbers from 1 (the first step) to {top}")
        if step < 1 or (t.epochs is None and step > t.max_steps):
            raise ConfigError(f"trainer.profile_steps={list(t.profile_steps)}: step {step} is never run; "
                              f"list steps from 1 (the first step) to {top}")


def _validate_epochs(cfg: Config) -> None:
    epochs = cfg.trainer.epochs
    if epochs is None:
        return
    if epochs < 1:
        raise ConfigError(f"trainer.epochs={epochs} must be at least 1 (or null: trainer.max_steps decides)")
    if cfg.data.source not in ("sft", "classification", "qa"):
        raise ConfigError(f"trainer.epochs={epochs} counts passes over fine-tuning examples (data.source sft, "
                          f"classification or qa); data.source={cfg.data.source} is sampled for trainer.max_steps "
                          "steps: set trainer.epochs=null")


def _validate_head(cfg: Config) -> None:
    """A fine-tuning head (model.num_labels, num_choices or span_head, in the families that have them)
    and the data it trains on go together."""
    m, d = cfg.model, cfg.data
    num_labels, num_choices = getattr(m, "num_labels", 0), getattr(m, "num_choices", 0)
    span = getattr(m, "span_head", False)
    if num_labels < 0 or num_choices < 0 or num_choices == 1:
        raise ConfigError(f"model.num_labels={num_labels} (0: none, 1: a regression, N: classes) and model.num_choices="
                          f"{num_choices} (0: none, N >= 2 choices) take those values only")
    heads = ([f"model.num_labels={num_labels}"] if num_labels else []) + (
        [f"model.num_choices={num_choices}"] if num_choices else []) + (["model.span_head=true"] if span else [])
    if len(heads) > 1:
        raise ConfigError(f"{' and '.join(heads)}: a model has one fine-tuning head; keep one of them")
    if d.source == "qa" or span:
        if not span or d.source != "qa":
            raise ConfigError("extractive QA trains a span head on SQuAD files: set data=qa and model.span_head=true "
                              f"together (got data.source={d.source}, model.span_head={str(span).lower()})")
        if d.doc_stride < 1 or d.max_query_length < 1 or d.max_query_length + 4 > m.seq_length:
            raise ConfigError(f"data.doc_stride={d.doc_stride} and data.max_query_length={d.max_query_length} must be "
                              f"at least 1, and the query must leave room for context in model.seq_length={m.seq_length}")
        return
    if d.source != "classification":
        if heads:
            raise ConfigError(f"{heads[0]} fine-tunes on labelled examples: set data=classification "
                              f"(or {heads[0].split('=')[0]}=0 to pretrain)")
        return
    if d.task in CHOICE_TASKS:
        need = CHOICE_TASKS[d.task]
        if not num_choices or (need and num_choices != need):
            raise ConfigError(f"data.task={d.task} is multiple choice: set model.num_choices="
                              f"{need or 'the number of choices each example has'} (got {num_choices}), "
                              "and model.num_labels=0")
        return
    need = num_classes(d.task, d.labels, num_labels)
    if num_labels < 1 or need != num_labels:
        raise ConfigError(f"data.task={d.task} has {need or 'integer'} label(s) "
                          f"({'a regression' if need == 1 else 'classes'}), but model.num_labels={num_labels}; "
                          f"set model.num_labels={max(need, 1) if need else 'the number of classes'}"
                          + (" and model.num_choices=0" if num_choices else ""))


def _validate_vocab(cfg: Config) -> None:
    """The tokenizer's size where the config alone tells it (null ids, or a sentencepiece model still to
    train, which has at most the asked size); a given model file is checked when it is read."""
    tok, m = cfg.data.tokenizer, cfg.model
    known = tok.type == "null" or (tok.type == "sentencepiece" and not tok.model and cfg.data.source in ("stdlib", "stdlib_prose"))
    if known and tok.vocab_size > m.vocab_size:
        what = "null tokenizer's ids" if tok.type == "null" else "sentencepiece vocabulary to train"
        raise ConfigError(f"data.tokenizer.vocab_size={tok.vocab_size} (the {what}) is larger than model.vocab_size="
                          f"{m.vocab_size}; set model.vocab_size >= {tok.vocab_size} or data.tokenizer.vocab_size <= "
                          f"{m.vocab_size}")


def _validate_experts(cfg: Config, dp: int) -> None:
    """Expert parallelism (parallel.ep) splits a mixture's experts over ep of the dp ranks, expert tensor
    parallelism (parallel.expert_tp) each expert over the tp ranks."""
    p, m = cfg.parallel, cfg.model
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep} must be at least 1")
    if p.expert_tp not in (1, p.tp):
        raise ConfigError(f"parallel.expert_tp={p.expert_tp} must be 1 (experts whole on every tp rank) or "
                          f"parallel.tp={p.tp} (each expert split over the tp ranks)")
    if p.expert_tp > 1 and not getattr(m, "num_experts", 0):  # (tp itself divides ffn_size)
        raise ConfigError(f"parallel.expert_tp={p.expert_tp} splits the experts of a mixture of experts; "
                          f"model={m.name} has none (model.num_experts=0): use parallel.expert_tp=1")
    if p.ep == 1:
        return
    experts = getattr(m, "num_experts", 0)
    if not experts:
        raise ConfigError(f"parallel.ep={p.ep} splits the experts of a mixture of experts; model={m.name} has none "
                          "(model.num_experts=0): use parallel.ep=1")
    if experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.num_experts={experts} (each rank holds the same "
                          "number of experts)")
    if dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the data-parallel degree dp={dp}: the expert-parallel "
                          "ranks are data-parallel ranks")


def _validate_context(cfg: Config, family: Family) -> None:
    """Context parallelism (parallel.cp > 1) splits a causal language model's sequences."""
    p, m, d = cfg.parallel, cfg.model, cfg.data
    if family.cp_plan is None or family.kind != "decoder" or getattr(m, "fine_tuning_head", False):
        why = ("has a fine-tuning head" if family.cp_plan is not None and family.kind == "decoder" else
               f"is a {family.kind} family" if family.kind != "decoder" else "has no context-parallel plan")
        raise ConfigError(f"parallel.cp={p.cp} splits the sequences of a decoder language model (a family with a "
                          f"context-parallel plan, without a fine-tuning head); model.arch={m.arch} {why}: use "
                          "parallel.cp=1")
    if m.seq_length % (2 * p.cp):
        raise ConfigError(f"parallel.cp={p.cp} cuts each sequence into 2 x cp = {2 * p.cp} chunks (two a rank, for "
                          f"causal load balance); model.seq_length={m.seq_length} does not divide")
    if m.attention_backend == "unfused":
        raise ConfigError(f"parallel.cp={p.cp} runs its own blockwise ring attention, not "
                          "model.attention_backend=unfused: use model.attention_backend=auto or parallel.cp=1")
    if d.source == "sft" and d.packing:
        raise ConfigError(f"parallel.cp={p.cp} attends over whole sequences; data.packing=true keeps attention inside "
                          "each packed example, which the ring does not: use data.packing=false or parallel.cp=1")


def _validate_pipeline(p: ParallelConfig, m: ModelConfig, per_step: int, global_batch: int) -> None:
    schedule, v = p.pipeline_schedule, p.virtual_pipeline_size
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(f"parallel.pipeline_schedule={schedule} runs one stage per rank; "
                          f"virtual_pipeline_size={v} needs interleaved_1f1b or interleaved_zb")
    if schedule in ("interleaved_1f1b", "interleaved_zb") and v < 2:
        raise ConfigError(f"parallel.pipeline_schedule={schedule} needs virtual_pipeline_size >= 2 (got {v})")
    if schedule == "zbv" and v != 2:
        raise ConfigError(f"parallel.pipeline_schedule=zbv places exactly 2 stages per rank in a V; "
                          f"set virtual_pipeline_size=2 (got {v})")
    stages = p.pp * v
    stage_layer_ranges(m.num_layers, stages, p.layers_per_stage)
    micro = global_batch // per_step if per_step and global_batch % per_step == 0 else 0
    if micro and micro < p.pp:
        raise ConfigError(f"{micro} micro-batches per step (global_batch_size {global_batch} / (micro_batch_size * "
                          f"dp) {per_step}) is fewer than parallel.pp={p.pp}: the pipeline never fills")
    if micro and schedule in MULTI_STAGE and micro % p.pp:
        raise ConfigError(f"parallel.pipeline_schedule={schedule} needs the micro-batches per step ({micro}) "
                          f"to be a multiple of parallel.pp={p.pp}")


def _validate_fused_loss(m: ModelConfig) -> None:
    """model.fused_loss / loss_chunk_tokens (a family whose schema has them: GPT)."""
    if m.loss_chunk_tokens < 1:
        raise ConfigError(f"model.loss_chunk_tokens={m.loss_chunk_tokens} must be at least 1 (tokens per chunk of the "
                          "fused loss; its logits, chunk x vocabulary / tp in fp32, are the most it holds)")
    head = [f"model.{k}={getattr(m, k)}" for k in ("num_labels", "num_choices") if getattr(m, k, 0)]
    if m.fused_loss and head:
        raise ConfigError(f"model.fused_loss=true fuses the language-model head with its cross-entropy, but "
                          f"{' and '.join(head)} replaces that head with a score head; set model.fused_loss=false")


def parallel_dims(p: ParallelConfig, world_size: int):
    return ParallelDims.from_config(p, world_size)


def reject_unknown_keys(node: Any, path: str = "") -> None:
    """Hydra's `+key=value` opens a schema node for a new key; megalm knows no such key, so refuse it."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        known = {f.name for f in dataclasses.fields(schema)}
        extra = sorted(set(node.keys()) - known)
        if extra:
            raise ConfigError(f"unknown key(s) {', '.join(path + str(k) for k in extra)}; "
                              f"{schema.__name__} has: {', '.join(sorted(known))}")
    for key in node.keys():
        reject_unknown_keys(node._get_node(key), f"{path}{key}.")
