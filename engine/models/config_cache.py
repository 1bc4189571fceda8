"""`read_model_config`: a checkpoint's `ModelConfig`, cached per config file.

Reading a config through transformers imports its config classes, which takes about as
long as importing torch (transformers 5 pulls in torch.distributed's tensor package for a
Llama config): seconds at every engine start, for a record of a few dozen numbers. So the
normalized record is kept as JSON in `$NANOFLEX_CACHE/model-configs/`, keyed by the config
file's bytes, the transformers version and the source of the code that normalizes it; a
later start with the same config reads the JSON and never imports transformers. A record
JSON cannot carry unchanged (one that does not read back equal) is not cached, and the log
lines the first read wrote (a vision tower left out) are written again at each cached read.
`NANOFLEX_CONFIG_CACHE=0` turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

from engine.core.cache import cache_root, publish_file
from engine.models.config import ModelConfig, read_hf_config
from engine.models.multipliers import Multipliers

ENV = "NANOFLEX_CONFIG_CACHE"
"""Set to 0 to read every config through transformers."""
LOGGER = "nanoflex.engine"
"""The logger whose lines a first read writes are replayed on cached reads."""
NORMALIZERS = (
    "engine/models/config.py",
    "engine/models/hf_config.py",
    "engine/models/hf_readers.py",
    "engine/models/hf_hybrid_readers.py",
    "engine/models/idefics3.py",
    "engine/models/registry.py",
    "engine/models/multipliers.py",
    "engine/models/quant_config.py",
    "engine/models/vision_config.py",
    "policy/families.py",
    "policy/config_fields.py",
    "policy/config_json.py",
)
"""The files that turn a transformers config into a `ModelConfig` (the family table and its
readers), from the directory above the packages."""
FORMAT = 1
"""The cached record's layout; bumped when it changes."""


def read_model_config(model_dir: Path) -> ModelConfig:
    """`ModelConfig.from_hf(read_hf_config(model_dir))`, read from the cache where this
    config file was normalized before by the same code; raises as that does."""
    if os.environ.get(ENV, "1") == "0":
        return ModelConfig.from_hf(read_hf_config(model_dir))
    path = _cache_path(model_dir)
    cached = _load(path) if path is not None else None
    if cached is not None:
        for line in cached[1]:
            logging.getLogger(LOGGER).info("%s", line)
        return cached[0]
    lines: list[str] = []
    recorder = _Recorder(lines)
    logger = logging.getLogger(LOGGER)
    logger.addHandler(recorder)
    try:
        config = ModelConfig.from_hf(read_hf_config(model_dir))
    finally:
        logger.removeHandler(recorder)
    if path is not None:
        _store(path, config, lines)
    return config


class _Recorder(logging.Handler):
    """Keeps the messages of INFO and above written while it is attached."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _cache_path(model_dir: Path) -> Path | None:
    """The record's file, or None where the directory has no config.json to key it by."""
    config_file = model_dir / "config.json"
    try:
        digest = hashlib.sha256(config_file.read_bytes())
    except OSError:
        return None
    digest.update(f"format {FORMAT}".encode())
    digest.update(importlib.metadata.version("transformers").encode())
    packages = Path(__file__).parents[2]
    for name in NORMALIZERS:
        digest.update((packages / name).read_bytes())
    return cache_root() / "model-configs" / f"{digest.hexdigest()[:32]}.json"


def _to_json(config: ModelConfig, lines: list[str]) -> str:
    return json.dumps({"config": dataclasses.asdict(config), "log": lines}, sort_keys=True)


def _from_json(text: str) -> tuple[ModelConfig, list[str]]:
    """Raises ValueError, KeyError or TypeError on a record that does not fit."""
    record = json.loads(text)
    fields: dict[str, Any] = dict(record["config"])
    for field in dataclasses.fields(ModelConfig):
        value: Any = fields.get(field.name)
        if field.name == "multipliers":
            fields[field.name] = Multipliers(**{**value, "ssm_zxbcdt": tuple(value["ssm_zxbcdt"])})
        elif str(field.type).startswith("tuple") and isinstance(value, list):
            fields[field.name] = tuple(value)
    return ModelConfig(**fields), [str(line) for line in record["log"]]


def _load(path: Path) -> tuple[ModelConfig, list[str]] | None:
    """The cached record, or None where there is none or it does not read (then it is read
    afresh and written again)."""
    try:
        return _from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(path: Path, config: ModelConfig, lines: list[str]) -> None:
    """Cache the record where it reads back equal; a cache that cannot be written is no
    error (the next start reads the config through transformers again)."""
    text = _to_json(config, lines)
    try:
        if _from_json(text)[0] != config:
            return
    except (ValueError, KeyError, TypeError):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        publish_file(path, text)
    except OSError:
        pass
