"""trainer.cpu_allocator: with `reuse` the large blocks a CPU step frees stay in the process.

Whether a block is mapped on its own is read from glibc (mallinfo2), in a fresh process: the setting is
process-wide, and this test process may already hold it from a training run.
"""

import json
import subprocess
import sys

import pytest

from megalm.training import cpu_memory
from megalm.training.cpu_memory import apply_cpu_allocator, mapped_bytes

glibc = pytest.mark.skipif(cpu_memory._glibc() is None, reason="mallopt's settings are glibc's")

PROBE = """
import json, torch
from megalm.training.cpu_memory import apply_cpu_allocator, mapped_bytes

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def grows():  # bytes mapped on their own while a fresh 64 MiB tensor lives and after it is freed; resident after
    before, held = mapped_bytes(), resident()
    t = torch.ones(16 << 20)  # 64 MiB of fp32, written
    during = mapped_bytes() - before
    del t
    return during, mapped_bytes() - before, resident() - held

out = {"defaults": grows()}
for choice in ("system", "reuse"):
    assert apply_cpu_allocator(choice) is None
    out[choice] = grows()
print(json.dumps(out))
"""


@glibc
def test_reuse_keeps_large_tensors_off_their_own_mappings():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    # glibc's defaults: the tensor gets a mapping of its own, which its free unmaps (the next step faults it in
    # anew): nothing of it stays resident.
    assert out["defaults"][0] >= 64 << 20 and out["defaults"][1] == 0 and out["defaults"][2] < 8 << 20
    assert out["system"][:2] == out["defaults"][:2] and out["system"][2] < 8 << 20  # `system` changes nothing
    assert out["reuse"][:2] == [0, 0]  # from the heap, and back to it
    assert out["reuse"][2] >= 60 << 20  # the heap is not trimmed: its pages stay for the next tensor


def test_off_glibc_says_why_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_glibc", lambda: None)
    assert "not glibc" in apply_cpu_allocator("reuse")
    assert apply_cpu_allocator("system") is None
    assert mapped_bytes() == -1


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="trainer.cpu_allocator='tcmalloc' is not one of reuse, system"):
        apply_cpu_allocator("tcmalloc")


def test_a_cpu_training_run_applies_its_choice(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.train import run

    register_configs()
    seen = []
    monkeypatch.setattr(cpu_memory, "apply_cpu_allocator", lambda choice: seen.append(choice) or "a reason")
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[
            "model=gpt_tiny", "data=mock", "logging.curves=false", "trainer.max_steps=1", "trainer.eval_interval=0",
            "trainer.progress_bar=false", "trainer.num_threads=1", "trainer.cpu_allocator=system"]))
    run(cfg, tmp_path)
    assert seen == ["system"]
