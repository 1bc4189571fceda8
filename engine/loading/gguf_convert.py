"""GGUF checkpoints: converted once into a float safetensors model directory in the cache.

`gguf_model_dir(path)` returns `$NANOFLEX_CACHE/gguf/<file name>-<sha256 prefix>/`, building it
on first use (or the entry a read-only seed cache holds, `$NANOFLEX_SEED_CACHE`: the Docker
images convert the default model when they are built): config.json comes from the GGUF
metadata (through transformers for Llama and Qwen 2, through gguf_config.py for the families
whose metadata transformers reads in part), the tokenizer (with its chat template) through
transformers; every tensor is dequantized by the `gguf` package (llama.cpp's reference Python
code) to float32, so the converted model is the GGUF's numbers exactly, and the engine's
readers, placement and 4-bit compression treat it like any checkpoint. The cache key is the
file's content hash, so a moved or copied file is not converted again and a changed one is.
Tensors are read one at a time from the memory-mapped file and written in shards, so a
conversion never holds more than one shard in memory.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.core.cache import cache_root, publish_dir
from engine.core.gguf_cache import MANIFEST, converted_dir, file_digest
from engine.core.model_files import ModelLoadError
from engine.loading.gguf_config import gguf_config, is_read_here
from engine.loading.gguf_rope_factors import add_rope_factors
from engine.loading.gguf_tensors import GgufTensors, open_gguf

CONVERTER_VERSION = 1  # bump when the converted bytes change, so old cache entries are not used
SHARD_BYTES = 2 << 30


def gguf_model_dir(path: Path) -> Path:
    """The converted model directory of the GGUF file at `path`, converted now if needed."""
    digest = file_digest(path)
    done = converted_dir(digest)  # maybe under another file name
    if done is not None:
        return done
    final = cache_root() / "gguf" / f"{path.name.removesuffix('.gguf').lower()}-{digest[:16]}"
    print(f"nanoflex: converting {path.name} (once) into {final}", file=sys.stderr)
    return publish_dir(final, lambda tmp: convert_gguf(path, tmp, digest=digest), MANIFEST)


def convert_gguf(path: Path, out_dir: Path, *, digest: str) -> None:
    """Write config.json, generation_config.json, the tokenizer (if the file has one),
    float32 safetensors shards and the manifest for the GGUF file at `path` into `out_dir`."""
    tensors = open_gguf(path)  # checks the architecture and every tensor type first
    hf_config = gguf_config(tensors) if is_read_here(tensors) else _hf_config(path)
    add_rope_factors(hf_config, tensors)  # Llama 3.1's and Llama 4 Scout's rope scaling
    tensors.bind(hf_config)  # checks names and shapes against the model transformers builds
    hf_config.architectures = [tensors.model_class_name]
    hf_config.save_pretrained(out_dir)
    _set_dtype(out_dir / "config.json", "float32")
    _write_generation_config(hf_config, out_dir)
    if tensors.has_tokenizer:  # without one, prompts are token ids (as for any checkpoint)
        _save_tokenizer(path, out_dir)
    files = _write_shards(tensors, out_dir)
    manifest = {
        "source": str(path.resolve()),
        "sha256": digest,
        "architecture": tensors.architecture,
        "tensor_types": tensors.type_counts(),
        "skipped_tensors": tensors.skipped,
        "dtype": "float32",
        "files": files,
        "converter_version": CONVERTER_VERSION,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _hf_config(path: Path) -> Any:
    """transformers' config for the GGUF's metadata."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"transformers cannot read the config of {path.name}: {e}") from e


def _set_dtype(config_path: Path, dtype: str) -> None:
    """Record the weights' dtype under both names transformers has used (4.x `torch_dtype`,
    5.x `dtype`), so every reader of config.json sees it."""
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_generation_config(hf_config: Any, out_dir: Path) -> None:
    """bos/eos ids, where the scheduler reads every end-of-sequence id."""
    ids = {
        key: getattr(hf_config, key, None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(hf_config, key, None) is not None
    }
    (out_dir / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")


def _save_tokenizer(path: Path, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the GGUF's chat template), converted by
    transformers from the GGUF's vocabulary and merges."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError:  # an architecture transformers' GGUF config reader does not know:
            # the tokenizer is built from the vocabulary alone, as for any other architecture
            tokenizer = PreTrainedTokenizerFast.from_pretrained(
                str(path.parent), gguf_file=path.name
            )
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"transformers cannot read the tokenizer of {path.name}: {e}") from e
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").is_file():
        raise ModelLoadError(f"the tokenizer of {path.name} has no fast (tokenizer.json) form")


def _write_shards(tensors: GgufTensors, out_dir: Path) -> list[str]:
    """Every tensor as float32, in safetensors shards of at most SHARD_BYTES (one file, named
    model.safetensors, when it fits), with transformers' index file when there are several."""
    from safetensors.numpy import save_file

    shards = list(_plan_shards(tensors))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        arrays: dict[str, np.ndarray] = {name: tensors.read(name) for name in shard}
        save_file(arrays, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    if len(names) > 1:
        total = sum(4 * tensors.numel(name) for name in weight_map)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _plan_shards(tensors: GgufTensors) -> Iterator[list[str]]:
    """Model tensor names, in order, grouped so that each group's float32 bytes stay under
    SHARD_BYTES (a larger tensor gets a shard of its own)."""
    shard: list[str] = []
    size = 0
    for name in tensors.names:
        nbytes = 4 * tensors.numel(name)
        if shard and size + nbytes > SHARD_BYTES:
            yield shard
            shard, size = [], 0
        shard.append(name)
        size += nbytes
    if shard:
        yield shard
