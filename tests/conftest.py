import os
import sys

import pytest

# Tests never touch the network: wandb stays offline even if a test turns it on.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Two test workers share two cores: one torch thread each (and in every command a test starts, through
# trainer.num_threads=0's reading of it), not two each fighting over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _rank_processes_end_with_the_session():
    """The rank processes tests/distributed.py keeps for the session end with it, in this process."""
    yield
    if "distributed" in sys.modules:
        sys.modules["distributed"].close_all()


@pytest.fixture
def tiny_model_cfg():
    from megalm.models.gpt.config import GPTConfig
    return GPTConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=100, make_vocab_size_divisible_by=8)


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """A GPT run trained once for the session (gpt_tiny, GPT-2 layout, 30 steps on the stdlib with its
    own 1000-piece sentencepiece model): (run directory, transformers model of its exported
    weights, its tokenizer). The evaluation, harness and SFT tests share it."""
    import transformers
    from configs import load
    from megalm.convert import export_to_hf
    from megalm.data import load_tokenizer
    from megalm.train import run as train_run
    root = tmp_path_factory.mktemp("evaluate")
    cfg = load("model=gpt_tiny", "model.vocab_size=1024", "data.max_corpus_mb=1", "data.split='90,10,0'",
               "data.tokenizer.vocab_size=1000",
               f"data.cache_dir={root / 'cache'}", "trainer.max_steps=30", "trainer.eval_interval=0",
               "trainer.eval_steps=1", "trainer.progress_bar=false", "optimizer.lr=3e-3", "cluster.peak_flops=1e12")
    train_run(cfg, root / "run", 1)
    hf_dir = export_to_hf(root / "run", root / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval().double()
    return root / "run", hf, load_tokenizer(root / "run")


@pytest.fixture(scope="session")
def bert_run(tmp_path_factory):
    """A bert_tiny pretrained once for the session, a few steps on the stdlib's docstrings with its own
    tokenizer (its run directory): the fine-tuning tests start from it."""
    from configs import load
    from megalm.train import run as train_run
    root = tmp_path_factory.mktemp("bert_pretrained")
    train_run(load("model=bert_tiny", "model.vocab_size=1024", "data=stdlib_prose", "data.max_corpus_mb=1",
                   "data.tokenizer.vocab_size=1000", f"data.cache_dir={root / 'cache'}", "trainer.max_steps=10",
                   "trainer.eval_interval=0", "trainer.eval_steps=1", "trainer.progress_bar=false",
                   "cluster.peak_flops=1e12"), root / "run", 1)
    return root / "run"
