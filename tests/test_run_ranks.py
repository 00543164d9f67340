"""tests/distributed.py's run_ranks: results come back, and a rank that dies is reported at once."""

import os
import signal
import time

import pytest

from distributed import run_ranks


def _rank_and_world(rank, world):
    return rank, world


def _rank_1_exits(rank, world, how):
    import torch.distributed as dist
    dist.barrier()  # both ranks past the group's setup, which a peer dying inside would fail on rank 0
    if rank == 1:
        if how == "exit":
            os._exit(3)  # no exception, no report: as a crash in native code looks from outside
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer does
    # Rank 0 waits without noticing (a collective could notice the closed peer and raise first):
    # only run_ranks watching the processes can end the call before its timeout.
    time.sleep(600)
    return rank


def test_every_rank_reports_its_result():
    assert run_ranks(2, _rank_and_world) == [(0, 2), (1, 2)]


@pytest.mark.parametrize("how,reason", [("exit", "exit code 3"), ("kill", f"killed by signal {int(signal.SIGKILL)}")])
def test_a_rank_that_dies_without_reporting_fails_the_call_naming_it(how, reason):
    # The timeout is far above a spawn (a few seconds) and far below the default 240 s: if dead
    # ranks were noticed only at the timeout, this would fail with "no answer" instead.
    with pytest.raises(AssertionError) as e:
        run_ranks(2, _rank_1_exits, how, timeout=60)
    assert str(e.value).startswith(f"rank 1 exited without reporting a result ({reason})"), str(e.value)
