"""Configs for tests, composed once a process for each list of overrides.

Hydra's compose takes 0.2-0.6 s (it reads and merges every YAML of the defaults list), and the suite
asks for the same overrides many times: a layout test composes its config once for the parent's
reference and once for each rank. Tests compose in the parent and hand the ranks the Config object
(plain dataclasses pickle), and each call here returns a deep copy of the first composition, so a
test that changes its config changes only its own. Errors are not cached: a bad override raises on
every call.
"""

import copy
import functools

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megalm.config import conf_dir
from megalm.models.registry import register_configs

register_configs()


@functools.lru_cache(maxsize=None)
def _load(overrides: tuple):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


def load(*overrides):
    """The Config these overrides compose to (no validation): `python -m megalm.train`'s, before its checks."""
    return copy.deepcopy(_load(tuple(overrides)))


@functools.lru_cache(maxsize=None)
def _planned(overrides: tuple, gpus):
    from megalm.plan import compose as plan_compose
    return plan_compose(list(overrides), gpus)


def plan_config(overrides, gpus=None):
    """megalm.plan.compose's (Config, world size): composed and validated for that world."""
    cfg, world = _planned(tuple(overrides), gpus)
    return copy.deepcopy(cfg), world
