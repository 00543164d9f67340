from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megalm.config import conf_dir
from megalm.models.registry import register_configs
from megalm.validation import reject_unknown_keys, validate
from megalm.launch import plan_world, ranks_needed

register_configs()
CONF = Path(conf_dir())


def load(*overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        dcfg = compose("config", overrides=list(overrides))
    reject_unknown_keys(dcfg)
    return OmegaConf.to_object(dcfg)


def group_files(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# A model whose shape divides every shipped layout, for the layout presets.
BIG = "model=gpt_175b"
EXTRA = {("data", "indexed"): ["data.paths=[/corpus/prefix]", "data.tokenizer.model=/tok.model"],
         ("model", "gpt_tiny"): ["data=mock"],  # 256 ids: smaller than the default corpus's 8192-piece tokenizer
         ("model", "moe_tiny"): ["data=mock"]}
# BERT reads sentences, not the default code corpus; bert_tiny's 256 ids fit only mock data.
EXTRA.update({("model", n): ["data=stdlib_prose"] for n in group_files("model") if n.startswith("bert_")})
EXTRA[("model", "bert_tiny")] = ["data=mock"]
EXTRA.update({("model", n): ["data=stdlib_prose_t5"] for n in group_files("model") if n.startswith("t5_")})
EXTRA[("model", "t5_tiny")] = ["data=mock"]
EXTRA[("data", "sft")] = ["data.paths=[/x/train.jsonl]", "data.tokenizer.model=/tok.model"]
EXTRA[("data", "classification")] = ["model=bert_cpu", "model.num_labels=2", "data.labels=[neg,pos]",
                                     "data.paths=[/x/train.jsonl]", "data.tokenizer.model=/tok.model"]
EXTRA[("data", "qa")] = ["model=bert_cpu", "model.span_head=true", "data.paths=[/x/train-v1.1.json]",
                         "data.tokenizer.model=/tok.model"]


@pytest.mark.parametrize("group,name", [(g, n) for g in ("model", "parallel", "optimizer", "data", "cluster")
                                        for n in group_files(g)])
def test_every_yaml_composes_and_validates(group, name):
    overrides = [f"{group}={name}"] + EXTRA.get((group, name), [])
    if group == "parallel":
        overrides += [BIG, "trainer.micro_batch_size=1", "trainer.global_batch_size=64"]
    cfg = load(*overrides)
    assert getattr(cfg, group).name == name or group == "optimizer"
    validate(cfg, ranks_needed(cfg))


@pytest.mark.parametrize("name", group_files("model"))
def test_every_model_preset_is_typed_by_its_family_schema(name, tmp_path):
    from megalm.models.registry import load_config
    from megalm.models import family_of
    cfg = load(f"model={name}", *EXTRA.get(("model", name), []))
    assert type(cfg.model) is family_of(cfg.model.arch).config
    # A run's frozen config.yaml reads back as the same typed config.
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and type(again.model) is type(cfg.model)


def test_a_model_of_another_schema_than_its_family_is_refused():
    import dataclasses
    from megalm.config import ModelConfig
    cfg = load("model=gpt_tiny", "data=mock")
    shared = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelConfig)}
    cfg.model = ModelConfig(**shared)  # arch=gpt, but only the shared fields
    with pytest.raises(ValueError, match=r"model.arch='gpt'.*ModelConfig.*GPTConfig"):
        validate(cfg, 1)


def test_there_are_presets_for_every_group():
    for group, must in {"model": {"gpt_tiny", "gpt_125m", "gpt_175b", "llama3_8b", "llama3_70b"},
                        "parallel": {"single", "tp2", "pp2", "dp2", "tp2_pp2_dp2", "tp8_pp16"},
                        "data": {"stdlib", "mock"}, "cluster": {"local"}}.items():
        assert must <= set(group_files(group))


def test_vocabulary_padding_follows_megatron():
    m = load(BIG).model
    assert (m.vocab_size, m.padded_vocab(1), m.padded_vocab(8)) == (50257, 50304, 51200)
    assert m.padded_vocab_size == 50304


def test_gpt3_175b_matches_the_paper():
    m = load(BIG).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (96, 12288, 96, 2048)


def test_validation_never_rewrites_values():
    cfg = load("parallel=tp2", "parallel.dp=-1", BIG, "trainer.micro_batch_size=1")
    before = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    validate(cfg, 8)  # dp = -1 resolves to 4 without touching cfg.parallel.dp
    assert cfg.parallel.dp == -1
    assert OmegaConf.to_yaml(OmegaConf.structured(cfg)) == before


BAD = [
    (["model.num_attention_heads=5"], 1, "model.hidden_size=256 is not divisible by model.num_attention_heads=5"),
    (["optimizer.lr=-0.001"], 1, "optimizer.lr=-0.001 must not be negative"),
    (["trainer.global_batch_size=12", "trainer.micro_batch_size=8"], 1,
     "trainer.global_batch_size=12 is not divisible by micro_batch_size(8) * dp(1) = 8"),
    (["parallel=tp2"], 1, "tp(2) * pp(1) * dp(1) * cp(1) = 2 != world size (1)"),
    (["parallel=dp2", "trainer.global_batch_size=24", "trainer.micro_batch_size=8"], 2,
     "trainer.global_batch_size=24 is not divisible by micro_batch_size(8) * dp(2) = 16"),
    (["model.num_query_groups=3"], 1, "model.num_attention_heads=4 is not divisible by model.num_query_groups=3"),
    (["model.position_embedding=alibi"], 1, "model.position_embedding='alibi' is not one of learned, rope"),
    (["data.prefetch=-1"], 1, "data.prefetch=-1 must not be negative"),
    (["optimizer.implementation=apex"], 1, "optimizer.implementation='apex' is not one of fused, foreach, for_loop"),
    (["trainer.compile=whole"], 1, "trainer.compile='whole' is not one of none, model, blocks"),
    (["trainer.cpu_allocator=jemalloc"], 1, "trainer.cpu_allocator='jemalloc' is not one of reuse, system"),
    (["trainer.compile=model", "trainer.compile_backend=tvm"], 1,
     "trainer.compile_backend='tvm' is not one of inductor, aot_eager, eager"),
    (["trainer.precision=fp8"], 1, "trainer.precision=fp8 runs through Transformer Engine"),
    (["trainer.precision=fp16", "trainer.hysteresis=0"], 1, "trainer.hysteresis=0 must be positive"),
    (["model.transformer_impl=te"], 1, "model.transformer_impl=te needs Transformer Engine"),
    (["parallel=tp4", "model=gpt_tiny", "model.num_query_groups=2"], 4,
     "model.num_query_groups=2 is not divisible by parallel.tp=4"),
    (["data.split=98"], 1, "data.split='98' needs 2 or 3 non-negative weights"),
    (["model.dropout=1.5"], 1, "model.dropout=1.5 must be in [0, 1)"),
    (["parallel.bucket_size_mb=0"], 1, "parallel.bucket_size_mb=0.0 must be positive, or null for Megatron's"),
    (["parallel.recompute_activation=true", "parallel.recompute=full"], 1,
     "with parallel.recompute=full the whole layer is recomputed already"),
    (["model=moe_tiny", "parallel.recompute_activation=true"], 1, "model.num_experts=4: the experts' activation"),
    (["parallel=tp2", "parallel.tp_comm_overlap=true"], 2,
     "parallel.tp=2 and parallel.sequence_parallel=false there are none"),
    (["parallel.tp_comm_overlap=true"], 1, "with parallel.tp=1 and parallel.sequence_parallel=false"),
    (["parallel=tp2_sp", "parallel.tp_comm_overlap=true", "trainer.compile=blocks"], 2,
     "trainer.compile=blocks traces the layers into graphs"),
    (["parallel=tp2", "model=gpt_tiny", "model.ffn_hidden_size=33"], 2,
     "model.ffn_size=33 is not divisible by parallel.tp=2"),
    (["parallel=tp2", "parallel.sequence_parallel=true", "model=gpt_tiny", "model.seq_length=33"], 2,
     "splits model.seq_length=33 over parallel.tp=2"),
    (["parallel=tp4", "model=gpt_tiny", "cluster=slurm_h100", "cluster.devices_per_node=2"], 4,
     "parallel.tp=4 is larger than cluster.devices_per_node=2 (cluster=slurm_h100)"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=3"], 2,
     "model.num_layers=3 does not split evenly over pp * virtual_pipeline_size = 2 stages"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=4", "parallel.layers_per_stage=[1,2]"], 2,
     "parallel.layers_per_stage=[1, 2] must be non-negative and sum to model.num_layers=4 (sums to 3)"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=4", "parallel.layers_per_stage=[4]"], 2,
     "parallel.layers_per_stage has 1 entries but the pipeline has pp * virtual_pipeline_size = 2 stages"),
    (["parallel=pp4", "model=gpt_tiny", "model.num_layers=8", "parallel.layers_per_stage=[4,0,2,2]"], 4,
     "only the first and last stage may hold no layer"),
    (["parallel=pp4", "model=gpt_tiny", "model.num_layers=4", "trainer.micro_batch_size=4",
      "trainer.global_batch_size=8"], 4, "2 micro-batches per step"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=4", "parallel.pipeline_schedule=interleaved_1f1b"], 2,
     "parallel.pipeline_schedule=interleaved_1f1b needs virtual_pipeline_size >= 2 (got 1)"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=8", "parallel.virtual_pipeline_size=2"], 2,
     "parallel.pipeline_schedule=1f1b runs one stage per rank"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=4", "parallel.pipeline_schedule=interleaved_1f1b",
      "parallel.virtual_pipeline_size=2", "trainer.micro_batch_size=2", "trainer.global_batch_size=6"], 2,
     "needs the micro-batches per step (3) to be a multiple of parallel.pp=2"),
    (["parallel.virtual_pipeline_size=2"], 1, "need pipeline parallelism (parallel.pp=1)"),
    (["parallel.recompute_num_layers=2"], 1, "parallel.recompute_num_layers=2 needs recompute=full (got none)"),
    (["parallel.recompute=some"], 1, "parallel.recompute='some' is not one of none, selective, full"),
    (["parallel=tp2"], 3, "tp(2) * pp(1) * dp(1) * cp(1) = 2 != world size (3)"),
    (["parallel=tp2", "parallel.dp=-1"], 3,
     "world size 3 is not divisible by tp(2) * pp(1) * cp(1) = 2, so dp=-1 has no whole value"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel=true needs parallel.tp > 1"),
    (["optimizer.min_lr=1.0"], 1, "optimizer.min_lr=1.0 is above optimizer.lr=0.001"),
    (["model.loss_chunk_tokens=0"], 1, "model.loss_chunk_tokens=0 must be at least 1"),
    (["model.fused_loss_backward=in_backward"], 1,
     "model.fused_loss_backward='in_backward' is not one of in_forward, recompute"),
    (["model.fused_loss=true", "model.num_labels=2"], 1,
     "model.fused_loss=true fuses the language-model head with its cross-entropy, but model.num_labels=2"),
    # Numbers torch or numpy would refuse (or turn into NaN) deep inside the run.
    (["optimizer.eps=-1"], 1, "optimizer.eps=-1.0 must be positive"),
    (["optimizer=sgd", "optimizer.momentum=-1"], 1, "optimizer.momentum=-1.0 must not be negative"),
    (["model.init_std=-1"], 1, "model.init_std=-1.0 must be positive"),
    (["model.init_std=0"], 1, "model.init_std=0.0 must be positive"),
    (["trainer.seed=-1"], 1, "trainer.seed=-1 must be in [0, 2**32)"),
    (["trainer.seed=4294967296"], 1, "trainer.seed=4294967296 must be in [0, 2**32)"),
    (["model.ffn_hidden_size=-1"], 1, "model.ffn_hidden_size=-1 must be at least 1 (or null: derived from hidden"),
    (["model.ffn_hidden_size=0"], 1, "model.ffn_hidden_size=0 must be at least 1 (or null: derived from hidden"),
    (["model.num_query_groups=-1"], 1, "model.num_query_groups=-1 must be at least 1 (or null: num_attention_heads"),
    (["model.num_query_groups=0"], 1, "model.num_query_groups=0 must be at least 1 (or null: num_attention_heads"),
    (["model.norm_eps=-1"], 1, "model.norm_eps=-1.0 must be positive"),
    (["model.norm_eps=0"], 1, "model.norm_eps=0.0 must be positive"),
    # Values a run would take and then train badly.
    (["optimizer.decay_steps=-5"], 1,
     "optimizer.decay_steps=-5 is the step the decay reaches min_lr at: it must be at least 1 and at least "
     "optimizer.warmup_steps=50"),
    (["optimizer.decay_steps=0", "optimizer.warmup_steps=0"], 1, "optimizer.decay_steps=0 is the step"),
    (["optimizer.decay_steps=10"], 1, "optimizer.decay_steps=10 is the step the decay reaches min_lr at: it must be "
                                      "at least 1 and at least optimizer.warmup_steps=50"),
    (["trainer.loss_scale=128"], 1, "trainer.loss_scale=128.0 applies to fp16 only (trainer.precision=fp32)"),
    (["trainer.precision=bf16", "trainer.loss_scale=64"], 1,
     "trainer.loss_scale=64.0 applies to fp16 only (trainer.precision=bf16)"),
    (["parallel.recompute=full", "parallel.recompute_num_layers=5"], 1, "parallel.recompute_num_layers=5 recomputes "
     "the first N blocks of each pipeline stage, but a stage holds at most 4"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=4", "trainer.micro_batch_size=4",
      "parallel.recompute=full", "parallel.recompute_num_layers=3"], 2,
     "parallel.recompute_num_layers=3 recomputes the first N blocks of each pipeline stage, but a stage "
     "holds at most 2"),
    (["parallel=pp2", "model=gpt_tiny", "model.num_layers=4", "trainer.micro_batch_size=4",
      "parallel.layers_per_stage=[1,3]", "parallel.recompute=full", "parallel.recompute_num_layers=4"], 2,
     "parallel.recompute_num_layers=4 recomputes the first N blocks of each pipeline stage, but a stage "
     "holds at most 3"),
    # A process group over nccl on CPU ranks: what auto would never pick.
    (["cluster=slurm_h100", "parallel=dp2", "trainer.micro_batch_size=4", "trainer.device=cpu"], 2,
     "cluster.backend=nccl (cluster=slurm_h100) runs on CUDA devices, but trainer.device=cpu puts this run's 2 "
     "rank(s) on the CPU: use cluster.backend=auto or gloo on CPU"),
]


@pytest.mark.parametrize("overrides,world,message", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_values_have_clear_errors(overrides, world, message):
    cfg = load(*overrides)
    with pytest.raises(ValueError) as e:
        validate(cfg, world)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides,world", [
    (["model.num_query_groups=null", "model.ffn_hidden_size=null", "optimizer.decay_steps=null"], 1),
    (["optimizer.decay_steps=50"], 1),  # decay_steps = warmup_steps: straight from lr to min_lr
    (["optimizer=sgd", "optimizer.momentum=0", "optimizer.decay_steps=1"], 1),
    (["trainer.seed=0"], 1), (["trainer.seed=4294967295"], 1),
    (["trainer.precision=fp16", "trainer.loss_scale=128"], 1),
    (["parallel.recompute=full", "parallel.recompute_num_layers=4"], 1),
    (["parallel=pp2", "model=gpt_tiny", "data=mock", "model.num_layers=4", "trainer.micro_batch_size=4",
      "parallel.layers_per_stage=[1,3]", "parallel.recompute=full", "parallel.recompute_num_layers=3"], 2),
    (["cluster=slurm_h100", "trainer.device=cpu"], 1),  # one process: no process group, no backend
    (["cluster=slurm_h100", "parallel=dp2", "trainer.micro_batch_size=4"], 2),  # auto: the cluster's GPUs
], ids=str)
def test_documented_sentinels_and_bounds_validate(overrides, world):
    validate(load(*overrides), world)


NCCL_DP2 = ["cluster=slurm_h100", "parallel=dp2", "trainer.micro_batch_size=4"]


def test_nccl_is_refused_when_the_run_starts_on_cpu(monkeypatch):
    """Launching (megalm.train), trainer.device=auto resolves here: no GPU, so CPU ranks, which nccl cannot join;
    megalm.plan, which models the cluster's GPUs, validates the same config."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load(*NCCL_DP2)
    validate(cfg, 2)  # megalm.plan
    with pytest.raises(ValueError) as e:
        validate(cfg, 2, launching=True)
    assert ("cluster.backend=nccl (cluster=slurm_h100) runs on CUDA devices, but trainer.device=auto puts this "
            "run's 2 rank(s) on the CPU (no CUDA device is visible): use cluster.backend=auto or gloo on CPU"
            ) in str(e.value)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    validate(load("cluster=slurm_h100"), 1, launching=True)  # one process: no process group
    validate(load(*NCCL_DP2, "cluster.backend=auto"), 2, launching=True)
    validate(load(*NCCL_DP2, "cluster.backend=gloo"), 2, launching=True)


def test_nccl_is_refused_when_torch_has_none(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    cfg = load(*NCCL_DP2)
    validate(cfg, 2, launching=True)  # GPUs and NCCL: it runs
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    validate(cfg, 2)  # megalm.plan
    with pytest.raises(ValueError) as e:
        validate(cfg, 2, launching=True)
    assert ("cluster.backend=nccl (cluster=slurm_h100) but this torch has no NCCL "
            "(torch.distributed.is_nccl_available() is false): use cluster.backend=auto or gloo") in str(e.value)


def test_unknown_key_is_an_error():
    with pytest.raises(Exception, match="Could not override 'model.hidden'"):
        load("model.hidden=3")
    with pytest.raises(ValueError, match="unknown key.*model.hidden"):
        load("+model.hidden=3")


def test_layout_too_big_for_this_machine_names_the_numbers(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    cfg = load(BIG, "parallel=tp8_pp16")
    with pytest.raises(ValueError) as e:
        plan_world(cfg)
    msg = str(e.value)
    assert "tp(8) * pp(16) * dp(1) * cp(1) = 128 ranks" in msg
    assert "torchrun --nnodes 16 --nproc-per-node 8" in msg and "srun" in msg
    assert "python -m megalm.plan" in msg  # what each rank would hold, worked out here


def test_torchrun_environment_sets_the_world(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "128")
    assert plan_world(load(BIG, "parallel=tp8_pp16")) == 128
