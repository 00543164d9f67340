"""Run a Hydra app so that a user's mistake reads as one megalm error, not a Hydra traceback.

Hydra prints its own errors (a misspelt key, a wrong type, an unknown preset) with a "use +"
hint that is wrong for megalm (unknown keys are refused) and a HYDRA_FULL_ERROR footer; errors
raised inside the task function come wrapped in a stripped traceback. `run_hydra_app` asks
Hydra to let every exception through (HYDRA_FULL_ERROR for the duration of the call), turns
Hydra's composition errors into ConfigErrors that list what is allowed, and prints them through
`megalm.errors.cli_errors`, as the task function does its own. Anything else keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import Any, Callable, List, NoReturn, Optional, Sequence

from megalm.config import Config, conf_dir
from megalm.errors import ConfigError, cli_errors, did_you_mean, full_errors
from megalm.models.registry import family_names, family_of


def _fields(schema: Any) -> List[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


GROUPS = ("model", "parallel", "optimizer", "data", "cluster")
"""The config groups conf/ holds presets for."""


def _field_type(key: str) -> Any:
    """The schema's type of a dotted key (model.* in any family's schema), Optional unwrapped; None if unknown."""
    head, *rest = key.split(".")
    roots = [family_of(a).config for a in family_names()] if head == "model" else [Config]
    if head != "model":
        rest = [head, *rest]
    for schema in roots:
        t: Any = schema
        for name in rest:
            hints = typing.get_type_hints(t) if dataclasses.is_dataclass(t) else {}
            if name not in hints:
                t = None
                break
            t = hints[name]
            args = [a for a in typing.get_args(t) if a is not type(None)]
            if typing.get_origin(t) is typing.Union and len(args) == 1:
                t = args[0]
        if t is not None:
            return t
    return None


def _group_presets(group: str) -> List[str]:
    return sorted(p.stem for p in (Path(conf_dir()) / group).glob("*.yaml") if not p.stem.endswith("_schema"))


def _ambiguous(override: str) -> ConfigError:
    """Hydra reads `key=a,b` as several values (a sweep): say how to write the one value the field takes."""
    key, _, value = override.partition("=")
    t = _field_type(key.lstrip("+~"))
    quoted = f"'{key}=\"{value}\"'"
    if t is str:
        how = f"{key} is a string: quote the commas, {quoted}"
    elif typing.get_origin(t) in (list, List) or t is list:
        how = f"{key} is a list: write {key}=[{value}]"
    else:
        how = f"write a list as {key}=[{value}] or a string with commas quoted, {quoted}"
    return ConfigError(f"{override}: Hydra reads a comma as several values (a sweep, with -m); {how}")


def explain_hydra_error(e: BaseException, overrides: Sequence[str] = ()) -> Optional[ConfigError]:
    """A ConfigError for a composition error Hydra raised over a user's override; None if it is not one.
    `overrides`: the command line's overrides, to name the one a message does not."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(e, ValueError) and str(e).startswith("Config group override must be a string"):
        nulls = [o.split("=", 1)[0] for o in overrides if o.split("=", 1)[0].lstrip("+") in GROUPS
                 and o.split("=", 1)[1:] in (["null"], ["~"], [""])]
        group = nulls[0].lstrip("+") if nulls else None
        if group is None:
            return ConfigError(f"a config group ({', '.join(GROUPS)}) was given no preset")
        return ConfigError(f"{nulls[0]}=null: the {group} group needs a preset; the {group} presets are: "
                           f"{', '.join(_group_presets(group))}")
    if isinstance(e, ConfigCompositionException) and str(e).startswith("Ambiguous value for argument"):
        override = str(e).split("\n")[0].split("'", 1)[-1].rsplit("'", 1)[0]
        return _ambiguous(override)

    if isinstance(e, MissingConfigException):
        missing = str(getattr(e, "missing_cfg_file", "") or "")
        # A family's schema (model/<arch>_schema) is in the group for presets to name, not a preset itself.
        options = [o for o in (getattr(e, "options", None) or []) if not str(o).endswith("_schema")]
        if "/" in missing and options:
            group, name = missing.rsplit("/", 1)
            return ConfigError(f"{group}={name} is not a {group} preset{did_you_mean(name, options)}; "
                               f"the {group} presets are: {', '.join(options)}")
        return ConfigError(str(e).split("\n")[0])
    if isinstance(e, OverrideParseException):
        return ConfigError(f"cannot read an override: {str(e).splitlines()[0]} (overrides look like key=value)")
    if not isinstance(e, ConfigCompositionException):
        return None
    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    schema = getattr(cause, "object_type", None)
    override = str(e).split("override ", 1)[-1].strip() if "override " in str(e) else None
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and key:
        name = key.rsplit(".", 1)[-1]
        known = _fields(schema)
        where = f"{schema.__name__}" if isinstance(schema, type) else "this section"
        near = did_you_mean(name, known, prefix=key[:-len(name)])
        return ConfigError(f"unknown key {key}{near}; {where} has: {', '.join(known)}")
    if isinstance(cause, ValidationError) and key:
        reason = str(cause).split("\n")[0]
        if "is not Optional" in reason:
            t = _field_type(key)
            if t is str:
                return ConfigError(
                    f"{key}=null: an unquoted null means 'no value', which {key} does not take; to pass the word "
                    f"null, quote it: '{key}=\"null\"'")
            name = getattr(t, "__name__", None) or str(t).replace("typing.", "")
            return ConfigError(f"{key}=null: {key} needs a value" + (f" ({name})" if t is not None else "")
                               + "; null (no value) is not one it takes")
        return ConfigError(f"{override or key}: {reason}")
    return ConfigError(str(e).split("\n")[0] + (f": {str(cause).splitlines()[0]}" if cause else ""))


def raise_explained(e: BaseException, overrides: Sequence[str] = ()) -> NoReturn:
    """Inside `except`: raise `e` as the ConfigError `explain_hydra_error` makes of it, or `e` itself when it is
    not a user's composition mistake or full errors were asked for (MEGALM_FULL_ERROR)."""
    explained = None if full_errors() else explain_hydra_error(e, overrides)
    if explained is None:
        raise e
    raise explained from None


def _check_run_dir(argv: List[str]) -> None:
    """hydra.run.dir / hydra.sweep.dir naming an existing file fails in Hydra with an OSError; say it plainly."""
    for arg in argv:
        for key in ("hydra.run.dir=", "hydra.sweep.dir="):
            if arg.startswith(key):
                path = Path(arg[len(key):]).expanduser()
                if path.exists() and not path.is_dir():
                    raise ConfigError(f"{arg}: {path} is a file, not a directory; name a directory for the run")
                parent = next((p for p in path.parents if p.exists()), None)
                if parent is not None and not parent.is_dir():
                    raise ConfigError(f"{arg}: {parent} is a file, so no directory can be made under it")
                _check_writable(arg, path if path.is_dir() else parent)


def _check_writable(arg: str, folder: Optional[Path]) -> None:
    """Make and remove a scratch folder in `folder` (a run directory or the nearest existing folder above it):
    a directory Hydra could not make fails here, before anything runs, with the system's reason."""
    import tempfile
    if folder is None:
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megalm-probe-", dir=folder))
    except OSError as e:
        raise ConfigError(f"{arg}: cannot make the run directory there: {folder}: {e.strerror}; name a folder "
                          "you can write to") from None


def run_hydra_app(app: Callable[[], Any], prog: str = "megalm") -> Any:
    """Call a @hydra.main function with megalm's error reporting (see the module doc).

    The task function reports its own megalm errors through cli_errors (a SystemExit passes
    through Hydra untouched); what reaches here is Hydra's composition errors, explained."""
    saved = {var: os.environ.get(var) for var in ("HYDRA_FULL_ERROR", "MEGALM_FULL_ERROR")}
    if (saved["HYDRA_FULL_ERROR"] or "").lower() in ("1", "true", "yes"):
        os.environ["MEGALM_FULL_ERROR"] = "1"  # the user asked Hydra for tracebacks: megalm's too
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing and exiting
    try:
        with cli_errors(prog):
            _check_run_dir(sys.argv[1:])
            try:
                return app()
            except Exception as e:
                raise_explained(e, sys.argv[1:])
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
