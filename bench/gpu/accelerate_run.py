"""Hugging Face Accelerate offloading as a baseline, timed with FlexGen's metric definitions.

Child entry point (what `bench.gpu.compare` starts, under a hard timeout):

    python -m bench.gpu.accelerate_run --model opt-30b [--prompt-len 512] [--gen-len 32]
        [--batch-size 8] [--gpu-mem BYTES] [--cpu-mem BYTES] [--device cuda] [--json OUT]

What `from_pretrained(..., device_map="auto", max_memory=..., offload_folder=...)` does,
without a checkpoint on disk: the model is built on the meta device, filled with the
same generated tensors nanoflex's `dummy:` model uses (engine/loading/dummy.py), placed by
`infer_auto_device_map` under the budgets and dispatched with `dispatch_model`
(layers that do not fit on the GPU stay in host memory and are copied in per
forward pass by Accelerate's hooks). The KV cache stays on the GPU, as in
transformers. Greedy decoding by hand, one forward per step, so prefill (the
prompt pass up to the first token) and decode are timed apart.

The GPU budget covers the weights Accelerate places plus what the batch needs
(KV cache at s + n, activations); `set_per_process_memory_fraction` enforces it.
On out-of-memory the batch is halved and the run repeated.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

WORKSPACE_RESERVE = 1 << 30
"""GPU bytes kept back from the weights for the CUDA context, logits and allocator slack."""


def build_model(model: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model on CPU with generated weights, its HF config) for a `dummy:` shape."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loading.dummy import DummyReader
    from engine.loading.generated import local_model_dir

    model_dir = local_model_dir(f"dummy:{model}")
    config = AutoConfig.from_pretrained(model_dir)
    reader = DummyReader.from_model_dir(model_dir, dtype=dtype)
    with init_empty_weights():
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name in reader.names:
        set_module_tensor_to_device(hf_model, name, "cpu", value=reader.get(name))
    hf_model.tie_weights()
    hf_model.eval()
    return hf_model, config


def gpu_reserve(config: Any, batch: int, total_len: int, dtype_bytes: int) -> int:
    """GPU bytes the batch needs beside the weights: KV cache and the widest activation."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * layers * kv_heads * head_dim * total_len * batch * dtype_bytes
    width = getattr(config, "ffn_dim", None) or 2 * config.intermediate_size
    activations = 4 * batch * total_len * width * dtype_bytes
    return kv + activations + WORKSPACE_RESERVE


def dispatch(hf_model: Any, config: Any, args: argparse.Namespace, offload_dir: str) -> Any:
    from accelerate import dispatch_model, infer_auto_device_map

    if args.device == "cpu":
        return hf_model
    total = torch.cuda.get_device_properties(0).total_memory
    gpu_mem = args.gpu_mem or total
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_mem / total), 0)
    reserve = gpu_reserve(config, args.batch_size, args.prompt_len + args.gen_len, 2)
    max_memory: dict[int | str, int] = {0: max(0, gpu_mem - reserve), "cpu": args.cpu_mem}
    device_map = infer_auto_device_map(
        hf_model,
        max_memory=max_memory,
        no_split_module_classes=hf_model._no_split_modules,
        dtype=torch.float16,
    )
    return dispatch_model(
        hf_model,
        device_map=device_map,
        offload_dir=offload_dir,
        skip_keys=getattr(hf_model, "_skip_keys_device_placement", None),
    )


def timed_generate(
    hf_model: Any, vocab: int, batch: int, prompt_len: int, gen_len: int, device: torch.device
) -> dict[str, Any]:
    """Greedy generation of `gen_len` tokens for `batch` random prompts, prefill timed apart."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    keep = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
    extra = {"logits_to_keep": 1} if keep else {}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=generator).to(device)
    with torch.no_grad():
        hf_model(input_ids=ids[:, :8], use_cache=True, **extra)  # warm-up
        sync()
        start = time.perf_counter()
        out = hf_model(input_ids=ids, use_cache=True, **extra)
        token = out.logits[:, -1].argmax(-1)
        sync()
        prefill_done = time.perf_counter()
        generated = [token]
        for _ in range(gen_len - 1):
            out = hf_model(
                input_ids=token[:, None], past_key_values=out.past_key_values, use_cache=True
            )
            token = out.logits[:, -1].argmax(-1)
            generated.append(token)
        sync()
        end = time.perf_counter()
    prefill_s, decode_s = prefill_done - start, end - prefill_done
    return {
        "num_prompts": batch,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "prefill_throughput": batch * prompt_len / prefill_s,
        "decode_throughput": batch * (gen_len - 1) / decode_s if decode_s > 0 else 0.0,
        "generation_throughput": batch * gen_len / (prefill_s + decode_s),
        "first_token_ids": [int(t[0]) for t in generated],
    }


def placement(hf_model: Any) -> dict[str, int]:
    """Bytes of parameters per device Accelerate chose ('cpu' for offloaded layers)."""
    device_map = getattr(hf_model, "hf_device_map", None) or {"": "cpu"}
    out: dict[str, int] = {}
    for name, p in hf_model.named_parameters():
        prefix = max((k for k in device_map if name.startswith(k)), key=len, default="")
        where = str(device_map.get(prefix, p.device))
        out[where] = out.get(where, 0) + p.numel() * p.element_size()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", required=True, help="built-in shape or config directory")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gpu-mem", type=int, default=None, help="bytes; default whole card")
    parser.add_argument("--cpu-mem", type=int, default=96 << 30, help="bytes")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    record: dict[str, Any] = {"ok": False, "requested_batch_size": args.batch_size}
    try:
        setup = time.perf_counter()
        hf_model, config = build_model(args.model, dtype)
        with tempfile.TemporaryDirectory(prefix="accelerate-offload-") as offload_dir:
            hf_model = dispatch(hf_model, config, args, offload_dir)
            record["setup_seconds"] = time.perf_counter() - setup
            record["placement_bytes"] = placement(hf_model)
            device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
            batch = args.batch_size
            while True:
                try:
                    metrics = timed_generate(
                        hf_model, config.vocab_size, batch, args.prompt_len, args.gen_len, device
                    )
                    break
                except torch.cuda.OutOfMemoryError:
                    if batch == 1:
                        raise
                    batch //= 2
                    torch.cuda.empty_cache()
                    print(f"out of memory: retrying with batch {batch}", file=sys.stderr)
        record.update(ok=True, batch_size=batch, metrics=metrics)
    except Exception as e:  # report any failure (OOM at batch 1, dispatch errors) as data
        traceback.print_exc()
        record["error"] = f"{type(e).__name__}: {e}"
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
