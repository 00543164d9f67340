"""Loading a checkpoint never runs code from it: DCP's metadata and non-tensor entries are
read by restricted unpicklers. Each attack is shown to work against DCP's defaults first, so the
test would notice a payload that proves nothing."""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megalm.training.checkpoint.safe_load import UnsafeCheckpointError, load_state, read_metadata

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": msd, "optim": osd}


def _load(path, template, safe):
    if safe:
        load_state(template, path)
    else:
        dcp.load(template, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner())


def test_a_real_checkpoint_loads_the_same_through_the_safe_reader(tmp_path):
    saved = _state()
    dcp.save(saved, checkpoint_id=str(tmp_path))
    template = _state()  # other weights and state, same keys
    template["optim"] = {k: (v.clone() * 0 if torch.is_tensor(v) else None) for k, v in template["optim"].items()}
    _load(tmp_path, template, safe=True)
    for part in ("model", "optim"):
        for k, v in saved[part].items():
            if torch.is_tensor(v):
                assert torch.equal(template[part][k], v), k
            else:
                assert template[part][k] == v, k  # lr, betas, flags: the non-tensor entries
    assert set(read_metadata(tmp_path).state_dict_metadata) >= {"model.weight", "optim.param_groups.weight.lr"}


def test_crafted_metadata_is_refused(tmp_path):
    dcp.save(_state(), checkpoint_id=str(tmp_path))
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(AttributeError):  # plain pickle: the command runs, then its result is no Metadata
        FileSystemReader(tmp_path).read_metadata()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|nt\.system"):
        _load(tmp_path, _state(), safe=True)
    assert not marker.exists()


def test_crafted_entry_is_refused(tmp_path):
    marker = tmp_path / "ran"
    state = _state()
    state["optim"]["param_groups.weight.lr"] = Payload(marker)  # torch.save pickles it at save time
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    _load(tmp_path / "ckpt", _state(), safe=False)  # DCP's default planner: the command runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match="param_groups.weight.lr"):
        _load(tmp_path / "ckpt", _state(), safe=True)
    assert not marker.exists()
