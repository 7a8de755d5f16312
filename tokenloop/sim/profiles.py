"""Profiles: a cost model and the facts of one model on one machine, as a JSON data file.

Shipped profiles live in `tokenloop/sim/profiles/*.json`; a profile is named by its file's stem, or given
as a path. A profile's file says where each number came from (`source`, `sources`).

Calibrated profiles of the machine a command runs on are cached under `$TOKENLOOP_CACHE_DIR/profiles/`
(default `~/.cache/tokenloop/profiles/`), one file per `CalibrationKey`: the machine (CPU model and core
count), the model, the dtype, the KV cache's dtype, the block size and the engine's step code, each of which
changes step costs (a bf16 KV cache reads half the bytes of an fp32 one). `simulate calibrate`
writes the file; a cached profile whose recorded key is not the one asked for is refused, both named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
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
    tensor_parallel: int = 1  # devices one engine spans (a datasheet profile states the degree it assumes)
    calibration: dict[str, Any] | None = None  # a calibrated profile's CalibrationKey, as written
    source: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    path: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str = "") -> Profile:
        where = path or "profile"
        try:
            cost = data["cost"]
            model = StepCostModel.from_dict(cost["coefficients"], cost.get("combine", "sum"), cost.get("overheads"),
                                            cost.get("forms"))
            return cls(name=str(data["name"]), model=str(data["model"]), hardware=str(data["hardware"]),
                       cost_model=model, max_model_len=int(data["max_model_len"]),
                       kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                       block_size=int(data.get("block_size", 16)),
                       kv_cache_memory_bytes=(int(data["kv_cache_memory_bytes"])
                                              if data.get("kv_cache_memory_bytes") is not None else None),
                       power_watts=(float(data["power_watts"]) if data.get("power_watts") is not None
                                    else None),
                       tensor_parallel=int(data.get("tensor_parallel", 1)),
                       calibration=dict(data["calibration"]) if data.get("calibration") else None,
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
    return _read_profile(path)


def _read_profile(path: Path) -> Profile:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return Profile.from_json(data, str(path))


def check_profile_fits(profile: Profile, *, model: str | None = None, block_size: int | None = None) -> None:
    """ProfileError naming both when `profile` was made for another model or block size than asked for."""
    if model is not None and profile.model != model:
        raise ProfileError(f"profile {profile.name!r} was made for model {profile.model!r}, not {model!r}: "
                           f"calibrate one for {model!r} (tokenloop simulate calibrate --model {model})")
    if block_size is not None and profile.block_size != block_size:
        raise ProfileError(f"profile {profile.name!r} is for block size {profile.block_size}, not {block_size}")


# ---- the calibration cache ---------------------------------------------------------------------

CACHE_ENV = "TOKENLOOP_CACHE_DIR"


def cache_dir() -> Path:
    """Where calibrated profiles are cached: $TOKENLOOP_CACHE_DIR/profiles, or ~/.cache/tokenloop/profiles."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "tokenloop") / "profiles"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def this_machine() -> str:
    """The machine as a calibration key knows it: CPU model and core count."""
    return f"{cpu_name()} x{os.cpu_count() or 1} cores"


_ENGINE_SOURCES = ("model", "runner.py", "sampler.py", "sampling_ops.py")  # under tokenloop/: what prices a step


def engine_fingerprint() -> str:
    """A short hash of the code that runs a step (the model, its C++ kernels, the runner, the sampler) and of
    torch's version: a faster kernel makes every cached profile of the engine before it wrong."""
    import torch  # only here: the rest of this module stays importable without torch's start-up cost

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(torch.__version__.encode())
    for name in _ENGINE_SOURCES:
        root = package / name
        for path in sorted(root.rglob("*") if root.is_dir() else [root]):
            if path.is_file() and path.suffix in (".py", ".cpp", ".h"):
                digest.update(path.relative_to(package).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibrated profile's step costs depend on: the machine, the model and its dtype, KV-cache dtype
    (`kv_cache_dtype` as configured: with the machine and the engine's code it fixes the KV layout) and block
    size, and the version of the engine's step code (`engine_fingerprint`)."""

    machine: str
    model: str
    dtype: str
    block_size: int
    kv_cache_dtype: str = "auto"
    engine: str = field(default_factory=engine_fingerprint)

    @classmethod
    def here(cls, model: str, dtype: str = "auto", block_size: int = 16,
             kv_cache_dtype: str = "auto") -> CalibrationKey:
        return cls(this_machine(), model, dtype, block_size, kv_cache_dtype)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def filename(self) -> str:
        """Readable, and unique by a hash of the whole key (a model path can be long or repeat a stem)."""
        def slug(text: str) -> str:
            return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:40]

        digest = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:10]
        kv = "" if self.kv_cache_dtype == "auto" else f"kv-{self.kv_cache_dtype}--"
        return (f"{slug(self.machine)}--{slug(Path(self.model).name or self.model)}--{self.dtype}--{kv}"
                f"bs{self.block_size}--{digest}.json")

    def path(self) -> Path:
        return cache_dir() / self.filename()


def cached_profile(key: CalibrationKey) -> Profile | None:
    """The cached calibrated profile for `key`, None if there is none; ProfileError if it is for another key."""
    path = key.path()
    if not path.is_file():
        return None
    profile = _read_profile(path)
    recorded = profile.calibration or {}
    for name, wanted in key.as_dict().items():
        if recorded.get(name) != wanted:
            raise ProfileError(f"cached profile {path} was calibrated for {name} {recorded.get(name)!r}, not "
                               f"{wanted!r}: delete it or run tokenloop simulate calibrate")
    return profile


def write_cached_profile(key: CalibrationKey, document: dict[str, Any]) -> Path:
    """Cache a calibrated profile document (it records `key` under "calibration"); returns its path."""
    path = key.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**document, "calibration": key.as_dict()}, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file
    return path


def fitted_profile(name: str, model: str, hardware: str, max_model_len: int, kv_bytes_per_token: int,
                   block_size: int, report: FitReport, command: str, measured: str) -> dict[str, Any]:
    """A profile's JSON from a fit of real steps (`tokenloop simulate calibrate`, scripts/device_check.py)."""
    return {
        "name": name, "model": model, "hardware": hardware,
        "max_model_len": max_model_len, "kv_bytes_per_token": kv_bytes_per_token, "block_size": block_size,
        "cost": {"combine": "sum", "coefficients": report.model.as_dict(),
                 **({"forms": report.model.forms.as_dict()} if report.model.forms.as_dict() else {})},
        "source": command,
        "sources": {"coefficients": f"NNLS fit (relative errors) of step durations (end - start) over "
                                    f"{report.num_steps} of {report.num_records} real steps, the others "
                                    f"trimmed as outliers; median |relative error| "
                                    f"{report.median_abs_rel_error:.3f}, mean step "
                                    f"{report.mean_step_s * 1e3:.1f} ms; measured {measured}",
                    "kv_bytes_per_token": "the loaded model's KV layout (layers x KV heads x head dim x "
                                          "dtype)"},
    }
