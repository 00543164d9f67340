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
from pathlib import Path
from typing import Any, Callable, List, NoReturn, Optional

from megalm.errors import ConfigError, cli_errors, did_you_mean, full_errors


def _fields(schema: Any) -> List[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def explain_hydra_error(e: BaseException) -> Optional[ConfigError]:
    """A ConfigError for a composition error Hydra raised over a user's override; None if it is not one."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

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
            return ConfigError(
                f"{key}=null: an unquoted null means 'no value', which {key} does not take; to pass the word "
                f"null, quote it: '{key}=\"null\"'")
        return ConfigError(f"{override or key}: {reason}")
    return ConfigError(str(e).split("\n")[0] + (f": {str(cause).splitlines()[0]}" if cause else ""))


def raise_explained(e: BaseException) -> NoReturn:
    """Inside `except`: raise `e` as the ConfigError `explain_hydra_error` makes of it, or `e` itself when it is
    not a user's composition mistake or full errors were asked for (MEGALM_FULL_ERROR)."""
    explained = None if full_errors() else explain_hydra_error(e)
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
                raise_explained(e)
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
