"""A GGUF file's tensors under transformers' names, dequantized to float32 by the `gguf` package.

GGUF names tensors llama.cpp's way (`blk.3.attn_q.weight`); transformers' names for the same
model (`model.layers.3.self_attn.q_proj.weight`) come from the model class transformers builds
for the file's config, mapped through gguf-py's own name table. What llama.cpp's converter did
to a tensor is undone here: the q and k rows of Llama-architecture files (and SmolLM3's)
permuted for its rotary kernel, and Gemma's norm weights stored as 1 + w (its RMSNorm scales by
1 + w). A mixture-of-experts file stacks each layer's experts (`blk.N.ffn_{gate,up,down}_exps`,
(experts, out, in)); they become transformers' stacked `experts.gate_up_proj` and
`experts.down_proj`, and DeepSeek's split `attn_k_b` / `attn_v_b` its kv_b_proj again
(gguf_joins.py). DeepSeek's and GLM's routing bias is `exp_probs_b.bias`, gpt-oss's attention
sinks `attn_sinks.weight`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.core.model_files import ModelLoadError
from engine.loading.gguf_joins import Join, find_join
from engine.models.hf_config import UnsupportedModelError
from policy.families import gguf_model_types

ARCHITECTURES = tuple(gguf_model_types())
"""GGUF architectures nanoflex converts, from the family table (Llama, Mistral and Mixtral
files are `llama`; Gemma 3's are the text model of either checkpoint; OLMo 3's are `olmo2`
with a window; DeepSeek-V3 and Kimi K2 are `deepseek2`). OPT has no GGUF form."""
RENAMED = {".e_score_correction_bias": ".e_score_correction.bias", ".sinks": ".sinks.weight"}
"""Parameter name endings llama.cpp's converter rewrites before looking the name up."""
PERMUTED_QK = frozenset({"llama", "smollm3"})
"""Architectures whose q/k rows llama.cpp permuted (the rest rotate halves, as transformers)."""
NORMS_PLUS_ONE = frozenset({"gemma2", "gemma3"})
"""Architectures whose `*norm.weight` tensors llama.cpp stored as 1 + w."""
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
"""Tensors that are config, not parameters: Phi-3's LongRoPE factors (gguf_config.py), Llama
3.1's rope scaling (gguf_rope_factors.py)."""


def open_gguf(path: Path) -> GgufTensors:
    """The file's tensors, after checking that its architecture is one nanoflex runs and that
    the installed `gguf` package can dequantize every tensor type in it."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:
        hint = (
            "; it holds a tensor type this gguf package does not know: pip install -U gguf"
            if "GGMLQuantizationType" in str(e)
            else ""
        )
        raise ModelLoadError(f"cannot read {path.name} as a GGUF file ({e}){hint}") from e
    tensors = GgufTensors(path, reader)
    tensors.check_types()
    return tensors


class GgufTensors:
    """Random access to a GGUF file's tensors by transformers' name, as float32 numpy arrays.
    `bind(hf_config)` must be called before `names`, `numel` and `read`."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self._reader = reader
        self._by_gguf_name = {t.name: t for t in reader.tensors}
        field = reader.fields.get("general.architecture")
        self.architecture = (
            bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
        )
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path.name} is a GGUF file of architecture {self.architecture!r}, which "
                f"nanoflex cannot convert; it converts {', '.join(ARCHITECTURES)} GGUF files "
                "(Llama, Mistral, Mixtral, Qwen 2 and 3, Qwen2/3-MoE, Gemma 2 and 3, Phi-3 and 4, "
                "OLMo 2 and 3, OLMoE, SmolLM3, DeepSeek-V3, Kimi K2, gpt-oss, GLM-4.5, Llama 4)"
            )
        self._gguf_names: dict[str, tuple[str, ...]] = {}  # transformers name -> GGUF names
        self._joins: dict[str, Join] = {}  # transformers name -> how its GGUF tensors make it
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._heads: dict[str, int] = {}  # GGUF name of a q/k tensor -> heads to un-permute
        self.model_class_name = ""
        self.skipped: list[str] = []
        """GGUF tensors the model has no parameter for (kept out of the conversion)."""

    def check_types(self) -> None:
        """Dequantize one row of each tensor type in the file: a type the gguf package cannot
        read fails here, before anything is written."""
        from gguf import dequantize

        first: dict[Any, Any] = {}
        for tensor in self._reader.tensors:
            first.setdefault(tensor.tensor_type, tensor)
        for qtype, tensor in first.items():
            data = tensor.data.reshape(-1, tensor.data.shape[-1])[:1]
            try:
                dequantize(data, qtype)
            except NotImplementedError as e:
                raise ModelLoadError(
                    f"{self.path.name} stores {tensor.name} as {qtype.name}, a GGUF tensor type "
                    f"the installed gguf package cannot dequantize ({e}); try `pip install -U "
                    "gguf`, or use a file quantized as Q4_0, Q4_1, Q5_*, Q8_0, K-quants or float"
                ) from e

    @property
    def reader(self) -> Any:
        """The gguf package's `GGUFReader` of the file (its metadata fields)."""
        return self._reader

    def tensor_names(self) -> set[str]:
        """Every tensor name in the file, llama.cpp's way."""
        return set(self._by_gguf_name)

    def raw_shape(self, gguf_name: str) -> tuple[int, ...]:
        """A tensor's shape by its GGUF name, in torch's layout (ggml's order reversed)."""
        return tuple(int(n) for n in reversed(self._by_gguf_name[gguf_name].shape.tolist()))

    def raw(self, gguf_name: str) -> np.ndarray:
        """A tensor by its GGUF name, dequantized, in torch's layout, nothing undone."""
        from gguf import dequantize

        tensor = self._by_gguf_name[gguf_name]
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        return values.reshape(self.raw_shape(gguf_name))

    @property
    def has_tokenizer(self) -> bool:
        """The file carries a tokenizer (vocabulary, merges, special ids, chat template)."""
        return "tokenizer.ggml.model" in self._reader.fields

    def type_counts(self) -> dict[str, int]:
        """{GGUF tensor type name: number of tensors}, for the manifest."""
        return dict(Counter(t.tensor_type.name for t in self._reader.tensors))

    def bind(self, hf_config: Any) -> None:
        """Name and check every tensor against the model transformers builds for `hf_config`
        (on the meta device): each parameter has a GGUF tensor of the same shape."""
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        self.model_class_name = type(model).__name__
        arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == self.architecture)
        table = get_tensor_name_map(arch, hf_config.num_hidden_layers)
        present = self.tensor_names()
        for name, param in _parameters(model):  # tied parameters appear once
            join = find_join(name, self.architecture, present)
            sources = join.sources if join is not None else self._source(table, name)
            missing = [g for g in sources if g not in present]
            if missing:
                raise ModelLoadError(
                    f"{self.path.name} has no tensor for the model's {name} (GGUF name "
                    f"{missing[0]}); is the file complete?"
                )
            shapes = [self.raw_shape(g) for g in sources]
            if join is not None:
                shape = join.shape(shapes)
                self._joins[name] = join
            elif param.dim() == 2 and param.shape[0] == 1 and shapes[0] == param.shape[1:]:
                shape = (1, *shapes[0])  # a (1, n) matrix stored as (n,): a shared expert's gate
            else:
                shape = shapes[0]
            if shape != tuple(param.shape):
                raise ModelLoadError(
                    f"{self.path.name}: {' + '.join(sources)} has shape {shape}, the model's "
                    f"{name} needs {tuple(param.shape)}"
                )
            self._gguf_names[name] = sources
            self._shapes[name] = shape
        used = {g for sources in self._gguf_names.values() for g in sources}
        self.skipped = [t for t in self._by_gguf_name if t not in used and t not in CONFIG_TENSORS]
        if self.architecture in PERMUTED_QK:
            heads = hf_config.num_attention_heads
            kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
            for gguf_name in used:
                if ".attn_q." in gguf_name or ".attn_k." in gguf_name:
                    self._heads[gguf_name] = heads if ".attn_q." in gguf_name else kv_heads

    def _source(self, table: Any, name: str) -> tuple[str]:
        """The GGUF tensor of transformers' parameter `name`, through gguf-py's name table."""
        for ending, renamed in RENAMED.items():
            if name.endswith(ending):
                name = name.removesuffix(ending) + renamed
        module, _, suffix = name.rpartition(".")
        gguf_module = table.get_name(module)
        return (f"{gguf_module}.{suffix}",) if gguf_module is not None else ("?",)

    @property
    def names(self) -> list[str]:
        return list(self._gguf_names)

    def numel(self, name: str) -> int:
        return math.prod(self._shapes[name])

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` (transformers' name), dequantized to float32, in torch's layout,
        with what llama.cpp's converter did to it undone."""
        sources = self._gguf_names[name]
        join = self._joins.get(name)
        if join is not None:
            return np.ascontiguousarray(join.build([self.raw(g) for g in sources]))
        gguf_name = sources[0]
        values = self.raw(gguf_name)
        if gguf_name in self._heads:
            values = _unpermute_rows(values, self._heads[gguf_name])
        if self.architecture in NORMS_PLUS_ONE and gguf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # as transformers' Gemma2TensorProcessor does
        return np.ascontiguousarray(values.reshape(self._shapes[name]))


def _parameters(model: Any) -> list[tuple[str, Any]]:
    """The model's parameters and persistent buffers (DeepSeek's and GLM's routing bias)."""
    state = model.state_dict()
    named = dict(model.named_parameters())
    buffers = [(n, b) for n, b in model.named_buffers() if n in state and n not in named]
    return [*named.items(), *buffers]


def _unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Within a head, transformers' rows are (half, pair): the
    two rotary halves one after the other; llama.cpp interleaves them, (pair, half)."""
    rows = values.shape[0]
    split = values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:])
    return split.swapaxes(1, 2).reshape(values.shape)
