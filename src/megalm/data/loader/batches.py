"""From datasets to this rank's micro-batches: Megatron's pretraining-sampler order
(MicroBatchLoader), built ahead in a background thread (Prefetcher), samples stacked by collate.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from megalm.errors import DataError


class DataExhaustedError(IndexError):
    """The loader was asked for samples beyond those the dataset was built for."""



def collate(samples: Sequence) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
    """Stack samples (arrays, or dicts of arrays with the same keys) into a micro-batch."""
    if isinstance(samples[0], dict):
        return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
    return torch.from_numpy(np.stack(samples).astype(np.int64))


class MicroBatchLoader:
    """This data-parallel rank's micro-batches, with Megatron's pretraining-sampler order.

    The global batch starting at consumed sample c holds samples [c, c + G). Micro-batch j of
    it gives rank r the samples c + j*mbs*dp + r*mbs + [0, mbs). Every rank walks the same
    global order, so resuming from `consumed_samples` continues exactly where training was.
    """

    def __init__(self, dataset: Sequence, *, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0):
        if micro_batch_size < 1 or dp_size < 1:
            raise DataError(f"micro_batch_size={micro_batch_size} and dp_size={dp_size} must be at least 1")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        per_step = micro_batch_size * dp_size
        if global_batch_size < 1 or global_batch_size % per_step:
            raise DataError(f"global_batch_size={global_batch_size} is not a positive multiple of "
                            f"micro_batch_size({micro_batch_size}) * dp_size({dp_size}) = {per_step}")
        if consumed_samples < 0:
            raise DataError(f"consumed_samples={consumed_samples} must not be negative")
        self.dataset = dataset
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.num_micro_batches = global_batch_size // per_step

    def indices(self) -> List[List[int]]:
        """Sample indices of this rank's micro-batches in the next global batch."""
        mbs, c = self.micro_batch_size, self.consumed_samples
        base = c + self.dp_rank * mbs
        return [list(range(base + j * mbs * self.dp_size, base + j * mbs * self.dp_size + mbs))
                for j in range(self.num_micro_batches)]

    def _check_available(self) -> None:
        n = len(self.dataset) if hasattr(self.dataset, "__len__") else None
        last = self.consumed_samples + self.global_batch_size - 1
        if n is not None and last >= n:
            name = getattr(self.dataset, "name", "the")
            raise DataExhaustedError(
                f"{name} dataset was built for {n} samples, but the global batch at consumed_samples="
                f"{self.consumed_samples} needs samples {self.consumed_samples}..{last}; build the data for "
                f"as many samples as training draws: build_data(..., num_samples=num_samples_for(max_steps, "
                f"global_batch_size, eval_interval, eval_steps))")

    def next_batch(self) -> List[Union[torch.Tensor, Dict[str, torch.Tensor]]]:
        """This rank's micro-batches of the next global batch: samples stacked, each (mbs, seq_length + 1)
        for GPT samples, or a dict of stacked fields for dict samples."""
        self._check_available()
        batches = [collate([self.dataset[i] for i in idx]) for idx in self.indices()]
        self.consumed_samples += self.global_batch_size
        return batches

    def __iter__(self):
        while True:
            yield self.next_batch()


def _pinned(batch: Union[torch.Tensor, Dict[str, torch.Tensor]]) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
    if isinstance(batch, dict):
        return {k: v.pin_memory() for k, v in batch.items()}
    return batch.pin_memory()


class Prefetcher:
    """A MicroBatchLoader whose next global batches (`depth` of them) are built in a background thread while
    the step computes, in the loader's order; with `pin`, in pinned memory, so the copy to a CUDA device
    does not block. `consumed_samples` counts the batches handed out, not those built ahead, so a
    checkpoint resumes where training was; setting it (a resume) drops what was built ahead.

    A thread, not worker processes: building a batch is index lookups into memory-mapped arrays and numpy
    copies, which release the GIL, and one process keeps the loader's position exact without sharing it.
    An error while building a batch (the data running out) is raised by the `next_batch` that would have
    returned that batch."""

    def __init__(self, loader: MicroBatchLoader, depth: int, pin: bool = False):
        if depth < 1:
            raise DataError(f"data.prefetch={depth}: a prefetcher holds at least 1 batch (0: use the loader itself)")
        self.loader, self.depth, self.pin = loader, depth, pin
        self._consumed = loader.consumed_samples
        self._thread: Optional[threading.Thread] = None

    @property
    def consumed_samples(self) -> int:
        return self._consumed

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.close()
        self._consumed = value

    def next_batch(self) -> List[Union[torch.Tensor, Dict[str, torch.Tensor]]]:
        """The loader's next global batch (see MicroBatchLoader.next_batch), built ahead."""
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()  # the thread has stopped; a later call starts again from the batch that failed
            raise item
        batches, self._consumed = item
        return batches

    def _start(self) -> None:
        self.loader.consumed_samples = self._consumed
        self._queue: queue.Queue = queue.Queue(self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._build, args=(self._queue, self._stop), daemon=True,
                                        name="megalm-prefetch")
        self._thread.start()

    def _build(self, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                batches = self.loader.next_batch()
                item: Any = ([_pinned(b) for b in batches] if self.pin else batches, self.loader.consumed_samples)
            except BaseException as e:  # handed to the consumer, raised where that batch was due
                item = e
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def close(self) -> None:
        """Stop the background thread and drop the batches it built ahead."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
