"""Settings, read once from RINGSYNC_* environment variables into a Config object."""
import os
from dataclasses import asdict, dataclass, replace
from typing import Mapping, Optional

from .errors import UsageError


@dataclass(frozen=True)
class Config:
    timeout_seconds: float = 300.0  # RINGSYNC_TIMEOUT_SECONDS: longest wait without progress
    iface: Optional[str] = None  # RINGSYNC_IFACE: interface name or IP address to listen on

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "Config":
        values = {}
        timeout = environ.get("RINGSYNC_TIMEOUT_SECONDS")
        if timeout:
            values["timeout_seconds"] = _positive_float("RINGSYNC_TIMEOUT_SECONDS", timeout)
        if environ.get("RINGSYNC_IFACE"):
            values["iface"] = environ["RINGSYNC_IFACE"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def as_dict(self):
        return asdict(self)


def _positive_float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a number") from None
    if value <= 0:
        raise UsageError(f"{name}={text!r} must be positive")
    return value
