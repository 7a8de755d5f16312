"""Profiles: a cost model and the facts of one model on one machine, as a JSON data file.

Shipped profiles live in `tokenloop/sim/profiles/*.json`; a profile is named by its file's stem, or given
as a path. A profile's file says where each number came from (`source`, `sources`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenloop.errors import TokenloopError
from tokenloop.sim.cost import FitReport, StepCostModel

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(TokenloopError, ValueError):
    """A profile that does not exist or does not parse; the message names the known ones or the field."""


@dataclass(frozen=True)
class Profile:
    """One model on one machine: its step costs and the sizes the simulated core needs."""

    name: str
    model: str
    hardware: str
    cost_model: StepCostModel
    max_model_len: int
    kv_bytes_per_token: int
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # the KV pool the machine holds (None: the engine default)
    power_watts: float | None = None  # board power while busy, for energy = power x modelled time
    source: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    path: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str = "") -> Profile:
        where = path or "profile"
        try:
            cost = data["cost"]
            model = StepCostModel.from_dict(cost["coefficients"], cost.get("combine", "sum"))
            return cls(name=str(data["name"]), model=str(data["model"]), hardware=str(data["hardware"]),
                       cost_model=model, max_model_len=int(data["max_model_len"]),
                       kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                       block_size=int(data.get("block_size", 16)),
                       kv_cache_memory_bytes=(int(data["kv_cache_memory_bytes"])
                                              if data.get("kv_cache_memory_bytes") is not None else None),
                       power_watts=(float(data["power_watts"]) if data.get("power_watts") is not None
                                    else None),
                       source=str(data.get("source", "")), sources=dict(data.get("sources", {})), path=path)
        except KeyError as exc:
            raise ProfileError(f"{where}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: {exc}") from None


def shipped_profiles() -> dict[str, Path]:
    """Name -> file of every profile shipped with tokenloop."""
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.json"))}


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file by path; ProfileError naming the known ones."""
    shipped = shipped_profiles()
    path = shipped.get(name_or_path)
    if path is None:
        candidate = Path(name_or_path)
        if candidate.suffix == ".json" and candidate.is_file():
            path = candidate
        else:
            raise ProfileError(f"unknown profile {name_or_path!r} (known: {', '.join(shipped) or 'none'}; "
                               "or give the path of a .json profile)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return Profile.from_json(data, str(path))


def fitted_profile(name: str, model: str, hardware: str, max_model_len: int, kv_bytes_per_token: int,
                   block_size: int, report: FitReport, command: str, measured: str) -> dict[str, Any]:
    """A profile's JSON from a fit of real steps (`tokenloop simulate calibrate`, scripts/device_check.py)."""
    return {
        "name": name, "model": model, "hardware": hardware,
        "max_model_len": max_model_len, "kv_bytes_per_token": kv_bytes_per_token, "block_size": block_size,
        "cost": {"combine": "sum", "coefficients": report.model.as_dict()},
        "source": command,
        "sources": {"coefficients": f"NNLS fit (relative errors) of step durations (end - start) over "
                                    f"{report.num_steps} of {report.num_records} real steps, the others "
                                    f"trimmed as outliers; median |relative error| "
                                    f"{report.median_abs_rel_error:.3f}, mean step "
                                    f"{report.mean_step_s * 1e3:.1f} ms; measured {measured}",
                    "kv_bytes_per_token": "the loaded model's KV layout (layers x KV heads x head dim x "
                                          "dtype)"},
    }
