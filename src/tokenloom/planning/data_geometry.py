"""The data geometry a plan hands to ``tokenloom build`` and the loader, as a JSON or YAML file.

Keys use Megatron-LM's argument names. Samples per split follow Megatron-LM's training loop:

* ``train_samples = train_iters x global_batch_size``
* ``valid_samples = (train_iters // eval_interval + 1) x eval_iters x global_batch_size``
* ``test_samples = eval_iters x global_batch_size``

and ``global_batch_size = micro_batch_size x data_parallel_size x gradient_accumulation_steps``,
the identity Megatron-core's ``ConstantNumMicroBatchesCalculator`` enforces.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from tokenloom.errors import ConfigError, FormatError
from tokenloom.validate import is_integer

FORMAT_NAME = "tokenloom-data-geometry"
FORMAT_VERSION = 1
_DERIVED = ("train_samples", "valid_samples", "test_samples")
_BALANCES = (None, "attention", "tokens")
"""``balance``'s values: ``tokenloom.index.balance.BALANCES`` and None (planning imports no index)."""


@dataclass(frozen=True, kw_only=True)
class DataGeometry:
    """How many samples of what shape each rank consumes; everything build and serve need to agree on."""

    seq_length: int
    """Tokens per sample (each sample reads ``seq_length + 1`` tokens for the shifted labels)."""
    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int
    """Samples per forward/backward pass on one rank."""
    data_parallel_size: int
    """Ranks that read different data (model replicas)."""
    gradient_accumulation_steps: int
    """Micro-batches per rank per step (Megatron's ``num_microbatches``)."""
    train_iters: int
    """Optimizer steps."""
    eval_interval: int = 1000
    """Steps between validation runs."""
    eval_iters: int = 100
    """Batches per validation run, and for the test run at the end."""
    tensor_model_parallel_size: int = 1
    """Ranks that share one data stream inside a replica (informational for the loader)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages per replica (informational for the loader)."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per stage (1 = no interleaving)."""
    balance: str | None = None
    """How the loader places each step's samples on the ranks: None (Megatron's order),
    ``"attention"`` or ``"tokens"`` (by cost; ``tokenloom.serve.BatchGeometry.balance``, which
    :meth:`BatchGeometry.from_data_geometry <tokenloom.serve.BatchGeometry.from_data_geometry>`
    carries). Written to the file only when set."""

    def __post_init__(self) -> None:
        if self.balance not in _BALANCES:
            raise ConfigError(f"DataGeometry.balance={self.balance!r}; expected one of {list(_BALANCES)}")
        for f in fields(self):
            if f.name == "balance":
                continue
            value = getattr(self, f.name)
            minimum = 0 if f.name == "eval_iters" else 1
            if not is_integer(value) or value < minimum:
                raise ConfigError(f"DataGeometry.{f.name} must be an integer >= {minimum}, got {value!r}")
            object.__setattr__(self, f.name, int(value))
        per_step = self.micro_batch_size * self.data_parallel_size * self.gradient_accumulation_steps
        if per_step != self.global_batch_size:
            raise ConfigError(
                f"DataGeometry.global_batch_size={self.global_batch_size} must equal micro_batch_size "
                f"({self.micro_batch_size}) x data_parallel_size ({self.data_parallel_size}) x "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) = {per_step}"
            )

    @property
    def train_samples(self) -> int:
        """Samples the training split must provide: ``train_iters x global_batch_size``."""
        return self.train_iters * self.global_batch_size

    @property
    def valid_samples(self) -> int:
        """Samples for validation: ``(train_iters // eval_interval + 1) x eval_iters x global_batch_size``."""
        return (self.train_iters // self.eval_interval + 1) * self.eval_iters * self.global_batch_size

    @property
    def test_samples(self) -> int:
        """Samples for the final test: ``eval_iters x global_batch_size``."""
        return self.eval_iters * self.global_batch_size

    @property
    def samples_per_split(self) -> tuple[int, int, int]:
        """(train, valid, test) samples, the order Megatron's dataset builder takes them in."""
        return (self.train_samples, self.valid_samples, self.test_samples)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the format tag, every field, and the derived sample counts."""
        out: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name != "balance" or self.balance is not None})
        out.update({name: getattr(self, name) for name in _DERIVED})
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "data geometry") -> DataGeometry:
        """Inverse of :meth:`to_dict`. Derived counts, when present, must agree with the fields."""
        if not isinstance(data, dict):
            raise FormatError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}")
        if data.get("format", FORMAT_NAME) != FORMAT_NAME:
            raise FormatError(f"{source}: format is {data.get('format')!r}, expected {FORMAT_NAME!r}")
        if data.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise FormatError(f"{source}: version {data.get('version')!r} is not supported, expected {FORMAT_VERSION}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - set(_DERIVED) - {"format", "version"})
        if unknown:
            raise FormatError(f"{source}: unknown keys {unknown}; known keys are {sorted(names | set(_DERIVED))}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise FormatError(f"{source}: missing keys {missing}")
        try:
            geometry = cls(**{k: v for k, v in data.items() if k in names})
        except ConfigError as exc:
            raise FormatError(f"{source}: {exc}") from exc
        for name in _DERIVED:
            if name in data and data[name] != getattr(geometry, name):
                raise FormatError(
                    f"{source}: {name}={data[name]!r} disagrees with the other keys, which give "
                    f"{getattr(geometry, name)}; remove it or fix train_iters/eval_interval/eval_iters"
                )
        return geometry

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as indented JSON; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def write_yaml(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as YAML (keys in field order); returns the path."""
        path = Path(path)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    def write(self, path: str | Path) -> Path:
        """Write YAML for ``.yaml``/``.yml`` paths, JSON otherwise."""
        return self.write_yaml(path) if Path(path).suffix.lower() in (".yaml", ".yml") else self.write_json(path)

    @classmethod
    def load(cls, path: str | Path) -> DataGeometry:
        """Read a file written by :meth:`write` (YAML by suffix, JSON otherwise)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise FormatError(f"{path}: cannot read data geometry file: {exc.strerror or exc}") from exc
        try:
            data = yaml.safe_load(text) if path.suffix.lower() in (".yaml", ".yml") else json.loads(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            kind = "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON"
            raise FormatError(f"{path}: not valid {kind}: {exc}") from exc
        return cls.from_dict(data, source=str(path))


__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "DataGeometry"]
