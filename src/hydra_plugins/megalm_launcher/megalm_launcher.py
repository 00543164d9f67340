"""Hydra launchers `megalm_slurm` and `megalm_local`: hydra-submitit-launcher's, with each job's resources
taken from its own layout and cluster profile.

The plugin's launchers (`submitit_slurm`, `submitit_local`) give every job of a sweep the same nodes and
tasks. A megalm job needs tp x pp x cp x dp ranks (dp = -1: the profile's cluster.nodes x
cluster.devices_per_node), one task a rank, on ceil(ranks / cluster.devices_per_node) nodes, with a GPU
a task unless trainer.device=cpu (SLURM) or on a machine without CUDA (local). These launchers compose
each job's config, work those out (`job_resources`) for every field the user left unset
(`hydra.launcher.nodes`, `tasks_per_node`, `gpus_per_node`), and submit the jobs that need the same
resources together, each under its own sweep number. A task then finds its rank in submitit's job
environment (megalm.train exports torch's rendezvous variables from it), so a sweep over layouts
(`-m parallel=single,tp2,pp2`) runs each job at its own size.

Registered only when hydra-submitit-launcher is installed (`pip install 'megalm[submitit]'`).
"""


import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore

log = logging.getLogger(__name__)

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # the submitit extra is not installed: no megalm launchers either
    BaseQueueConf = LocalQueueConf = SlurmQueueConf = LocalLauncher = SlurmLauncher = None

RESOURCE_KEYS = ("nodes", "tasks_per_node", "gpus_per_node")


def job_resources(cfg, executor: str) -> Dict[str, int]:
    """{nodes, tasks_per_node, gpus_per_node} of one job from its composed config: one task a rank."""
    p, c = cfg.parallel, cfg.cluster
    per_node = int(c.devices_per_node)
    if int(p.dp) > 0:
        ranks = int(p.tp) * int(p.pp) * int(p.cp) * int(p.dp)
    else:  # dp = -1: the profile's whole cluster, dp what is left
        ranks = int(c.nodes) * per_node
    nodes = math.ceil(ranks / per_node)
    tasks = min(ranks, per_node)
    if nodes * tasks != ranks:
        raise ValueError(f"the layout needs {ranks} ranks, which do not fill nodes of cluster.devices_per_node="
                         f"{per_node} evenly; choose a layout whose rank count is below or a multiple of it")
    if executor == "local":
        import torch
        gpus = tasks if torch.cuda.is_available() and cfg.trainer.device != "cpu" else 0
    else:
        gpus = 0 if cfg.trainer.device == "cpu" else tasks
    return {"nodes": nodes, "tasks_per_node": tasks, "gpus_per_node": gpus}


def make_executor(executor: str, params: Dict[str, Any]):
    """A submitit AutoExecutor for `executor` (slurm | local) with the launcher's `params`: the fields every
    executor shares (hydra-submitit-launcher's BaseQueueConf) by their own names, the others prefixed with
    the executor's (submitit's convention), unset ones left out."""
    import submitit
    from omegaconf import OmegaConf
    params = dict(params)
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    init = {f"{executor}_max_num_timeout": params.pop("max_num_timeout")} if "max_num_timeout" in params else {}
    out = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster=executor, **init)
    out.update_parameters(**{k if k in shared else f"{executor}_{k}": v for k, v in params.items() if v is not None})
    return out


class _PerJobResources:
    """Mixed into the plugin's launchers: `launch` groups jobs by `job_resources` and submits each group as
    one job array with those resources; results come back in the sweep's order."""

    _EXECUTOR: str

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides

        unset = [k for k in RESOURCE_KEYS if self.params.get(k) is None]
        groups: Dict[tuple, List[int]] = {}
        for i, overrides in enumerate(job_overrides):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            resources = job_resources(job_cfg, self._EXECUTOR)
            key = tuple((k, resources[k] if k in unset else self.params[k]) for k in RESOURCE_KEYS)
            groups.setdefault(key, []).append(i)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("megalm's '%s' launcher: %d job(s) in %s", self._EXECUTOR, len(job_overrides), sweep_dir)
        results: List[Any] = [None] * len(job_overrides)
        for key, members in groups.items():
            executor = make_executor(self._EXECUTOR, {**self.params, **dict(key)})
            state = Singleton.get_state()
            args = []
            for i in members:
                idx = initial_job_idx + i
                log.info("\t#%d : %s  (%s)", idx, " ".join(filter_overrides(job_overrides[i])),
                         ", ".join(f"{k}={v}" for k, v in key))
                args.append((list(job_overrides[i]), "hydra.sweep.dir", idx, f"job_id_for_{idx}", state))
            jobs = executor.map_array(self, *zip(*args))
            for i, job in zip(members, jobs):
                results[i] = job
        return [job.results()[0] for job in results]  # each job's rank 0 (task 0) has the return value


if SlurmLauncher is not None:
    class MegalmSlurmLauncher(_PerJobResources, SlurmLauncher):
        pass

    class MegalmLocalLauncher(_PerJobResources, LocalLauncher):
        pass

    _HERE = "hydra_plugins.megalm_launcher.megalm_launcher"

    @dataclass
    class _PerJobResourcesConf:
        """RESOURCE_KEYS unset by default: each job's own `job_resources` fill them."""
        nodes: Optional[int] = None
        tasks_per_node: Optional[int] = None
        gpus_per_node: Optional[int] = None

    @dataclass
    class MegalmSlurmConf(_PerJobResourcesConf, SlurmQueueConf):
        _target_: str = f"{_HERE}.MegalmSlurmLauncher"

    @dataclass
    class MegalmLocalConf(_PerJobResourcesConf, LocalQueueConf):
        _target_: str = f"{_HERE}.MegalmLocalLauncher"

    ConfigStore.instance().store(group="hydra/launcher", name="megalm_slurm", node=MegalmSlurmConf(),
                                 provider="megalm")
    ConfigStore.instance().store(group="hydra/launcher", name="megalm_local", node=MegalmLocalConf(),
                                 provider="megalm")
