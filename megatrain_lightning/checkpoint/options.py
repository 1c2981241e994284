"""``storage_options``: fsspec's keyword arguments (credentials, endpoint, profile) for a checkpoint's URL.

They are checked where they enter (the strategy's constructor): a mapping or None. They go to fsspec only;
anything that writes a configuration down (the ``megatrain`` command's saved ``config.yaml``, its
``--print_config``, its error lines) writes :data:`REDACTED` in place of each value, since credentials are
what these options usually carry. A saved config then holds the placeholder, which is refused when it comes
back as an option, so that a rerun from that file says where the secret went instead of failing to sign
its first request.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
"""What a written configuration holds in place of each ``storage_options`` value."""

SECRET_KEYS = ("storage_options",)
"""Option names whose values are redacted wherever a configuration is written."""

_FIX = (
    "give a dict of fsspec options such as {'profile': 'name'} or {'key': ..., 'secret': ...}, or None "
    "(fsspec's defaults: the AWS_* environment variables, ~/.aws)"
)


def check_storage_options(value: Any) -> dict[str, Any] | None:
    """`value` as a dict, or None; a one-line ValueError that does not quote it (it may hold a secret)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"storage_options is a {type(value).__name__}, not a mapping of option names: {_FIX}")
    if not all(isinstance(k, str) for k in value):
        raise ValueError(f"storage_options has keys that are not option names (strings): {_FIX}")
    placeholder = _first_redacted(value)
    if placeholder is not None:
        raise ValueError(
            f"storage_options[{placeholder!r}] is {REDACTED!r}, the placeholder a saved config holds instead of "
            "the secret: pass the credentials again (better: through the environment or an AWS profile)"
        )
    return dict(value)


def _first_redacted(value: Any, path: str = "") -> str | None:
    """The key path of the first :data:`REDACTED` leaf in `value`, or None."""
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return path if value == REDACTED else None
    for key, item in items:
        found = _first_redacted(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def redacted(value: Any) -> Any:
    """`value` with every leaf replaced by :data:`REDACTED`, its keys (and None) kept: what was given, not what."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(item) for item in value]
    return REDACTED


def redact_secrets(config: Any) -> Any:
    """A deep copy of a nested configuration (mappings, jsonargparse Namespaces, lists) with the values under
    any :data:`SECRET_KEYS` key redacted."""
    config = config.clone() if hasattr(config, "clone") else copy.deepcopy(config)
    _redact_in_place(config)
    return config


def _redact_in_place(config: Any) -> None:
    if isinstance(config, list):
        for item in config:
            _redact_in_place(item)
        return
    # a jsonargparse Namespace's keys() are flattened ("a.b.c"): its own attributes are the top level
    keys = list(config) if isinstance(config, dict) else list(vars(config)) if hasattr(config, "clone") else []
    for key in keys:
        if key in SECRET_KEYS:
            config[key] = redacted(config[key])
        else:
            _redact_in_place(config[key])
