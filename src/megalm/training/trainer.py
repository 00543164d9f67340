"""The training loop: gradient accumulation, clipping, schedule, evaluation, checkpoints, logging,
the step-time breakdown (training/step_time.py) and profiled steps (training/profiling.py)."""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from megalm.config import TrainerConfig
from megalm.data import MicroBatchLoader
from megalm.data.loader import Prefetcher
from megalm.data.provenance import tokenizer_record
from megalm.distributed.mesh import replica_mesh
from megalm.errors import TrainingError
from megalm.family import Family
from megalm.ops.routing import RoutingRecord, routing_step
from megalm.training.checkpoint import Checkpointer
from megalm.training.compiling import compile_report, compile_stats
from megalm.training.metrics import MetricLogger, Throughput, peak_memory_bytes
from megalm.training.monitor import Monitor
from megalm.parallel.context import weighted_loss
from megalm.parallel.grads import clip_grads, mean_over
from megalm.training.optim import LRSchedule, set_lr
from megalm.training.precision import DynamicLossScaler, autocast
from megalm.training.profiling import profile_step
from megalm.training.step_time import NoTimer, StepTimer, describe

log = logging.getLogger("megalm.trainer")
_stopped_on_signal = False  # signals are per process, and so is this record of one (stopped_on_signal)


def stopped_on_signal() -> bool:
    """True once a fit in this process stopped early because a stop signal reached some rank."""
    return _stopped_on_signal


class Trainer:
    def __init__(self, cfg: TrainerConfig, *, model: torch.nn.Module, family: Family, optimizer: torch.optim.Optimizer,
                 schedule: LRSchedule, data, checkpointer: Checkpointer, throughput: Throughput,
                 device: torch.device, metrics: Optional[MetricLogger] = None, mesh=None, layout=None,
                 pipeline=None, data_parallel=None, is_rank0: bool = True, run_dir: Optional[Path] = None,
                 prefetch: int = 0):
        """`metrics` may be set later (before fit): the run writes nothing until a resume is accepted.
        `layout`: what megalm.parallel.parallelize returned for this rank. `run_dir`: where profiled
        steps' traces go (trainer.profile_steps). `prefetch` (data.prefetch): training batches built
        ahead in a background thread (megalm.data.loader.Prefetcher); 0: in the step."""
        self.cfg, self.model, self.optimizer, self.schedule = cfg, model, optimizer, schedule
        self.data, self.checkpointer, self.metrics, self.throughput = data, checkpointer, metrics, throughput
        self.device, self.is_rank0, self.mesh, self.layout, self.pipeline = device, is_rank0, mesh, layout, pipeline
        self.pp_group = mesh["pp"].get_group() if mesh is not None and mesh["pp"].size() > 1 else None
        self.data_parallel = data_parallel
        self.inputs = family.inputs  # the batch keys the model's forward takes
        self.optional_inputs = family.optional_inputs  # and those it takes when a batch has them
        self.metric_names = tuple(getattr(model, "metric_names", ()))  # what model.loss_and_metrics reports
        self.num_experts = getattr(model.cfg, "num_experts", 0)  # a mixture of experts: its routing is reported
        # The tensors holding the final gradients: the parameters, or this rank's ZeRO shards of them.
        self.params = data_parallel.grad_params if data_parallel is not None else list(model.parameters())
        self.shard_group = data_parallel.dp_group if data_parallel is not None and data_parallel.sharded else None
        self.tp_group = mesh["tp"].get_group() if mesh is not None else None
        # Samples are split over dp; the loss is averaged over dp x cp, whose ranks each hold part of a sample
        # (context parallelism: megalm.parallel.context, this rank's place in the layout) and weight their losses
        # to it.
        self.context = getattr(layout, "context", None)
        self.dp_group = replica_mesh(mesh).get_group() if mesh is not None else None
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.dp_size = mesh["dp"].size() if mesh is not None else 1
        dp_rank, dp_size = self.dp_rank, self.dp_size
        self.step = 0
        self._first_step: Optional[int] = None  # the step fit() starts from (_diverged's first-step case)
        self.loader = MicroBatchLoader(data.train, micro_batch_size=cfg.micro_batch_size,
                                       global_batch_size=cfg.global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        if prefetch > 0:
            self.loader = Prefetcher(self.loader, prefetch, pin=device.type == "cuda")
        self.val_loss: Optional[float] = None
        self.val_metrics: Dict[str, float] = {}
        self.scaler = None
        if cfg.precision == "fp16":
            self.scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.loss_scale_window, cfg.hysteresis,
                                            cfg.min_loss_scale, static=cfg.loss_scale)
        self.skipped_steps = 0
        self.skips_in_a_row = 0
        self.run_dir = run_dir
        self.timer = StepTimer(device, pipeline) if cfg.time_breakdown else NoTimer()
        self.monitor = Monitor(cfg.monitor, cfg.monitor_mode, cfg.early_stopping_patience, cfg.early_stopping_min_delta)
        self.save_best = checkpointer.cfg.save_best and checkpointer.cfg.save
        self.watching = self.save_best or cfg.early_stopping_patience > 0
        if self.watching:
            reported = ["val_loss"] + ([] if getattr(model.cfg, "fine_tuning_head", False) else ["val_ppl"])
            self.monitor.check_names(reported + [f"val_{name}" for name in self.metric_names],
                                     "checkpoint.save_best, trainer.early_stopping_patience")
        self._improved = False  # the last evaluation was the best so far by trainer.monitor

    # -- state -----------------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        state = {"consumed_samples": self.loader.consumed_samples, "val_loss": self.val_loss,
                 "skipped_steps": self.skipped_steps, "tokenizer": tokenizer_record(self.data.tokenizer),
                 "monitor": self.monitor.state_dict()}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load(self, path, weights_only: bool = False, metadata=None) -> None:
        saved = self.checkpointer.load(path, self.model, None if weights_only else self.optimizer, self.data_parallel,
                                       metadata, self.layout)
        if self.data_parallel is not None and self.data_parallel.main_params:
            self.data_parallel.gather_params()  # the load filled the fp32 main parameters: the weights follow
        if not weights_only:
            self.step = saved["step"]
            self.loader.consumed_samples = saved["consumed_samples"]
            self.val_loss = saved.get("val_loss")
            self.skipped_steps = saved.get("skipped_steps", 0)
            self.monitor.load_state_dict(saved.get("monitor"))
            if self.scaler is not None and "loss_scaler" in saved:
                self.scaler.load_state_dict(saved["loss_scaler"])
            log.info("resuming at step %d (consumed samples %d)", self.step, self.loader.consumed_samples)
        else:
            log.info("fine-tuning from the weights of %s (saved at step %d): step 0, a fresh optimizer",
                     path, saved.get("step", 0))

    def _autocast(self):
        return autocast(self.cfg.precision, self.device.type)

    # -- one step --------------------------------------------------------------------------------
    def _batches(self, loader) -> List[Dict[str, torch.Tensor]]:
        """The loader's next micro-batches as the model's batch dicts, on this rank's device."""
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in self.data.batch(mb).items()}
                   for mb in loader.next_batch()]
        return batches if self.context is None else [self.context.split(b) for b in batches]

    def _joined(self, micro_batches: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """One batch of the micro-batches, for the pipeline schedule to split again the same way."""
        return {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}

    def _loss(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The model's loss on a batch, and its metrics (None when it reports none)."""
        output = self.model(*(batch[k] for k in self.inputs + tuple(k for k in self.optional_inputs if k in batch)))
        if self.metric_names:
            loss, values = self.model.loss_and_metrics(output, batch)
            return weighted_loss(loss, batch), values
        return weighted_loss(self.model.loss(output, batch), batch), None

    def _named(self, values: Optional[torch.Tensor], prefix: str = "") -> Dict[str, float]:
        """The model's metrics, averaged over dp, by name."""
        if values is None:
            return {}
        values = mean_over(values, self.dp_group)
        return {prefix + name: v for name, v in zip(self.metric_names, values.tolist())}

    def train_step(self) -> Dict[str, float]:
        with self.timer.step():
            return self._train_step()

    def _train_step(self) -> Dict[str, float]:
        timer = self.timer  # each phase() mark: from here on the time goes to that part
        self.model.train()
        timer.phase("data")
        micro_batches = self._batches(self.loader)
        timer.phase("other")
        lr = self.schedule(self.step)
        set_lr(self.optimizer, lr)
        total = torch.zeros((), device=self.device)
        extra = torch.zeros(len(self.metric_names), device=self.device) if self.metric_names else None
        scale = self.scaler.scale if self.scaler is not None else 1.0
        # A mixture's aux losses count as the loss does: per micro-batch, loss-scaled, and x cp, since context
        # parallelism averages gradients over cp ranks whose aux losses are parts of the whole (megalm.ops.routing).
        aux_scale = scale / len(micro_batches) * (self.context.size if self.context is not None else 1)
        with routing_step(aux_scale) as routing:
            if self.pipeline is not None:
                # The schedule splits the batch into the same micro-batches and averages their gradients.
                joined = self._joined(micro_batches)
                timer.phase("pipeline")  # forward and backward interleave in the schedule: compute + idle
                with self._autocast():
                    total = self.pipeline.step(joined, loss_scale=scale)
                timer.phase("other")
                extra = self.pipeline.last_metrics
            else:
                for batch in micro_batches:
                    timer.phase("forward")
                    with self._autocast():
                        loss, values = self._loss(batch)
                        loss = loss / len(micro_batches)
                    timer.phase("backward")
                    (loss * scale if scale != 1.0 else loss).backward()
                    timer.phase("other")
                    total += loss.detach()
                    if values is not None:
                        extra += values / len(micro_batches)
        timer.phase("optimizer")
        if self.data_parallel is not None:
            self.data_parallel.finish()  # wait for the dp reductions; sum tp / embedding replicas
        overflow = False
        if self.scaler is not None:
            overflow = self.scaler.unscale_and_check(self.params)  # agreed over every rank
            self.scaler.update(overflow)
        if overflow:
            norm = torch.tensor(float("inf"))
            self._skip(scale, mean_over(total, self.dp_group).item())
        else:
            norm, finite = clip_grads(self.params, self.cfg.grad_clip, self.tp_group, self.pp_group,
                                      self.shard_group, getattr(self.layout, "ep_group", None))
            if not finite:  # the norm is global, so every rank stops here together
                self._diverged(norm.item(), mean_over(total, self.dp_group).item())
            self.optimizer.step()
            self.skips_in_a_row = 0
        self.optimizer.zero_grad(set_to_none=True)
        timer.phase("other")
        self.step += 1
        tokens = micro_batches[0][self.inputs[0]].shape[1] * (self.context.size if self.context is not None else 1)
        self.throughput.add(self.cfg.global_batch_size * tokens)  # tokens a sample
        out = {"loss": mean_over(total, self.dp_group).item(), "lr": lr, "grad_norm": norm.item(),
               **self._named(extra)}
        if self.scaler is not None:
            out.update(loss_scale=scale, skipped=int(overflow), skipped_steps=self.skipped_steps)
        if self.num_experts:
            out.update(self._moe_report(routing, len(micro_batches)))
        return out

    def _moe_report(self, routing: RoutingRecord, micro_batches: int) -> Dict[str, float]:
        """The step's routing: aux and z losses (summed over layers, each stage's, averaged over micro-batches
        and dp), the share of assignments dropped, the busiest expert's load over the mean (the most of any
        layer and micro-batch), and the assignments each expert took (summed over layers and the whole batch)."""
        values = routing.values(micro_batches, self.num_experts).to(self.device)
        sums, load = torch.cat([values[:4], values[5:]]), values[4:5].clone()
        # Summed over stages (their layers) and over tp and cp (each rank's tokens: parts of the micro-batch's
        # losses), averaged over dp.
        groups = [self.pp_group] + ([self.mesh[d].get_group() for d in ("tp", "cp", "dp") if self.mesh[d].size() > 1]
                                    if self.mesh is not None else [])
        for group in groups:
            if group is not None:
                torch.distributed.all_reduce(sums, group=group)
                torch.distributed.all_reduce(load, op=torch.distributed.ReduceOp.MAX, group=group)
        dp = self.mesh["dp"].size() if self.mesh is not None else 1
        aux, z, dropped, assigned = sums[:4].tolist()
        return {"moe_aux_loss": aux / (micro_batches * dp), "moe_z_loss": z / (micro_batches * dp),
                "moe_dropped": dropped / max(assigned, 1.0), "moe_load_max": load.item(),
                "moe_tokens_per_expert": [int(c) for c in sums[4:].round().tolist()]}

    def _skip(self, scale: float, loss: float) -> None:
        """fp16 overflow: skip the update as Megatron does, but stop a run whose scale cannot recover."""
        self.skipped_steps += 1
        self.skips_in_a_row += 1
        log.warning("step %d: fp16 gradients overflowed at loss scale %g on some rank; every rank skips "
                    "the update (loss scale now %g)", self.step + 1, scale, self.scaler.scale)
        limit = self.cfg.max_consecutive_skips
        if limit and self.skips_in_a_row >= limit:
            raise TrainingError(
                f"step {self.step + 1}: {self.skips_in_a_row} fp16 steps in a row overflowed (trainer."
                f"max_consecutive_skips={limit}; loss {loss:.4g}, loss scale now {self.scaler.scale:g}), so "
                f"training is not progressing. Lower optimizer.lr (now {self.optimizer.param_groups[0]['lr']:.3g}) "
                f"or use trainer.precision=bf16; {self._kept()}")

    def _diverged(self, norm: float, loss: float) -> None:
        if not math.isfinite(loss) and self.step == self._first_step:
            # Not a divergence: the model's first forward, before any update here, is already non-finite.
            raise TrainingError(
                f"step {self.step + 1}: the loss is {loss} at this run's first step, before any update, in "
                f"{self.cfg.precision} training: the model's starting weights or its config (model.init_std, "
                f"model.norm_eps, the precision) or the data give non-finite values, which no learning rate "
                f"changes; {self._kept()}")
        raise TrainingError(
            f"step {self.step + 1}: the gradient norm is {norm} (loss {loss:.4g}) in {self.cfg.precision} training: "
            f"it diverged. Lower optimizer.lr (now {self.optimizer.param_groups[0]['lr']:.3g}) or lengthen "
            f"optimizer.warmup_steps; {self._kept()}")

    def _kept(self) -> str:
        last = self.checkpointer.latest_published()
        return (f"the last checkpoint, {last}, is kept and a rerun resumes from it" if last is not None
                else "no checkpoint was written")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the same eval_steps global batches of validation data every time (the
        model's metrics, averaged the same way, in `val_metrics`)."""
        self._settle_weights()
        self.model.eval()
        loader = MicroBatchLoader(self.data.valid, micro_batch_size=self.cfg.micro_batch_size,
                                  global_batch_size=self.cfg.global_batch_size,
                                  dp_rank=self.dp_rank, dp_size=self.dp_size)
        losses, extras = [], []
        for _ in range(self.cfg.eval_steps):
            micro_batches = self._batches(loader)
            if self.pipeline is not None:
                with self._autocast():
                    losses.append(self.pipeline.step(self._joined(micro_batches), train=False))
                extras.append(self.pipeline.last_metrics)
                continue
            for batch in micro_batches:
                with self._autocast():
                    loss, values = self._loss(batch)
                losses.append(loss.float())
                extras.append(values)
        self.val_metrics = self._named(torch.stack(extras).mean(0) if self.metric_names else None, "val_")
        return mean_over(torch.stack(losses).mean(), self.dp_group).item()

    def _eval_and_log(self, bar) -> None:
        if self.cfg.eval_steps == 0:
            return
        self.val_loss = self.evaluate()
        record = {"step": self.step, "val_loss": self.val_loss}
        if not getattr(self.model.cfg, "fine_tuning_head", False):  # a language model's loss: its perplexity too
            record["val_ppl"] = math.exp(min(self.val_loss, 50.0))
        record.update(self.val_metrics)
        self._improved = self.watching and self.monitor.update(self._agreed(record), self.step)
        self.metrics.write(record)
        if self.is_rank0:
            shown = [f"perplexity {record['val_ppl']:.1f}"] if "val_ppl" in record else []
            shown += [f"{k[4:]} {v:.4f}" for k, v in self.val_metrics.items()]
            log.info("step %d: validation loss %.4f%s%s", self.step, self.val_loss,
                     f" ({', '.join(shown)})" if shown else "", self._watched())

    def _agreed(self, record: Dict[str, float]) -> Dict[str, float]:
        """record with rank 0's trainer.monitor value on every rank, so all ranks save and stop together."""
        if not torch.distributed.is_initialized():
            return record
        value = torch.tensor([record[self.monitor.metric]], dtype=torch.float64, device=self.device)  # nccl: on GPU
        torch.distributed.broadcast(value, src=0)
        return dict(record, **{self.monitor.metric: value.item()})

    def _watched(self) -> str:
        """What the evaluation did to trainer.monitor, for its log line (nothing when nothing watches it)."""
        m = self.monitor
        if not self.watching:
            return ""
        if self._improved:
            return f"; best {m.metric} so far"
        if m.best is None:
            return f"; {m.metric} is NaN"
        return f"; {m.metric} not better than {m.best:.4f} (step {m.best_step}) for {m.stale} evaluation(s)"

    def _save(self, best: bool = False) -> None:
        self._settle_weights()
        self.checkpointer.save(self.step, self.model, self.optimizer, self.state(), self.data_parallel, self.layout,
                               best=best)
        self.throughput.reset()  # do not charge the save to the next report's tokens/s

    # -- the loop --------------------------------------------------------------------------------
    def _settle_weights(self) -> None:
        """The weights complete before they are read outside a training forward (parallel.overlap_param_gather
        leaves the update's all-gathers running into the next forward)."""
        if self.data_parallel is not None:
            self.data_parallel.wait_params()

    def _peak_memory(self) -> Dict[str, Any]:
        """Peak memory of this rank, and of every rank when distributed (they differ by stage)."""
        mine = peak_memory_bytes(self.device) / 2**30
        out: Dict[str, Any] = {"peak_mem_gb": mine}
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, mine)
            out["peak_mem_gb_per_rank"] = [round(x, 4) for x in every]
            out["peak_mem_gb"] = max(every)
        return out

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def _stop_requested(self) -> bool:
        """SIGTERM / SIGUSR1 (cluster preemption) seen on any rank; agreed so all ranks save together."""
        flag = torch.tensor(1.0 if self._signal is not None else 0.0, device=self.device)  # nccl: on the GPU
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def fit(self) -> Optional[float]:
        self._signal = None
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (an embedding application): leave signals alone
                pass
        try:
            return self._fit()
        finally:
            if hasattr(self.loader, "close"):
                self.loader.close()  # the prefetching thread, and the batches it built ahead
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _fit(self) -> Optional[float]:
        c = self.cfg
        self._first_step = self.step  # the step this process starts from: no update of its own before it
        if self.metrics is None:
            self.metrics = MetricLogger(None, None, {})
        bar = tqdm(total=c.max_steps, initial=self.step, disable=not (self.is_rank0 and c.progress_bar),
                   dynamic_ncols=True, desc="train", unit="step")
        if c.compile != "none":
            before = compile_stats()  # this run's compilation (evaluation's graphs included) counts from here
        with logging_redirect_tqdm():
            if self.monitor.exhausted:  # a rerun of a run that stopped early: it stays stopped
                log.info("step %d: this run stopped early (trainer.monitor=%s last improved at step %s); nothing to "
                         "train (raise trainer.early_stopping_patience to go on)", self.step, c.monitor,
                         self.monitor.best_step)
                bar.close()
                self.metrics.close()
                return self.val_loss
            if c.eval_at_start and self.step == 0:
                self._eval_and_log(bar)
                if self._improved and self.save_best:  # the starting weights are the ones to beat
                    self._save(best=True)
            self.throughput.reset()
            t_start = time.perf_counter()
            profiled = set(c.profile_steps)
            compiled_logged, compiled = False, None  # trainer.compile: its cost, in the next metrics record
            while self.step < c.max_steps:
                try:
                    if self.step + 1 in profiled:
                        with profile_step(self.run_dir, self.step + 1, self.device):
                            out = self.train_step()
                    else:
                        out = self.train_step()
                except TrainingError:
                    self.checkpointer.finish()  # a background save of an earlier, good step still lands
                    bar.close()
                    raise
                bar.update(1)
                if c.compile != "none" and not compiled_logged:
                    # The first step compiled the graphs (its interval's tokens/s includes that): say what it cost.
                    compiled_logged = True
                    compiled = compile_stats(since=before)
                    if self.is_rank0:
                        log.info("step %d: trainer.compile=%s: %s", self.step, c.compile, compile_report(compiled))
                last = self.step == c.max_steps
                if self.step % c.log_interval == 0 or last:
                    out.update(self.throughput.report())
                    out.update(self.timer.report())
                    out.update(step=self.step, consumed_samples=self.loader.consumed_samples,
                               elapsed_s=time.perf_counter() - t_start,
                               **self._peak_memory(), **(compiled or {}))
                    compiled = None
                    self.metrics.write(out)
                    bar.set_postfix(loss=f"{out['loss']:.3f}", lr=f"{out['lr']:.2e}",
                                    tok_s=f"{out['tokens_per_s']:.0f}", refresh=False)
                    if self.is_rank0:  # with the bar too: train.log keeps every interval (the bar stays below)
                        log.info("step %d/%d loss %.4f lr %.3g %.0f tok/s%s", self.step, c.max_steps,
                                 out["loss"], out["lr"], out["tokens_per_s"],
                                 f" | {describe(out)}" if "time_step_s" in out else "")
                evaluated = last or (c.eval_interval > 0 and self.step % c.eval_interval == 0)
                if evaluated:
                    self._eval_and_log(bar)
                best = evaluated and self._improved and self.save_best
                stopping = not last and evaluated and self.monitor.exhausted
                exiting = not last and c.exit_interval is not None and self.step % c.exit_interval == 0
                signalled = not last and self._stop_requested()
                if best or self.checkpointer.due(self.step, last or exiting or signalled or stopping):
                    self._save(best)
                if stopping:
                    m = self.monitor
                    since = f"improved on {m.best:.4f} (step {m.best_step})" if m.best is not None else "been a number"
                    log.info("step %d: stopping early: %s has not %s for %d evaluations (trainer.early_stopping_"
                             "patience=%d)", self.step, c.monitor, since, m.stale, c.early_stopping_patience)
                    break
                if exiting or signalled:
                    if signalled:
                        global _stopped_on_signal
                        _stopped_on_signal = True
                    why = "a stop signal arrived" if signalled else f"trainer.exit_interval={c.exit_interval} reached"
                    log.info("step %d: %s; saved and stopping (start again in this run directory to resume)",
                             self.step, why)
                    break
            self.checkpointer.finish()  # an async save still being written lands before the exit
        self._settle_weights()  # the model is whole when fit returns
        bar.close()
        self.metrics.close()
        return self.val_loss
