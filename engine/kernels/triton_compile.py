"""Compile every CUDA kernel of engine/kernels for a GPU architecture, with no GPU present.

    python -m engine.kernels.triton_compile [--arch 90]

Each kernel of triton_attention.py and triton_dense.py is compiled from its source for sm_90
(the H100 and H200) by default, specialized as a launch for a Llama-3-8B layer would be
(`COMPILE_CASES` of each module: argument types, constants; pointers 16-byte aligned and
strides multiples of 16), and its registers, spills (stack and local memory), shared memory
and cubin size are printed as JSON: what "read the compiler's report before a GPU session"
asks for, and a kernel that does not compile for Hopper fails CI
(tests/engine/kernels/test_triton_attention.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.kernels import triton_attention, triton_dense, triton_paged
from engine.kernels.triton_launch import Kernel, available


def cases() -> dict[str, tuple[Kernel, list[str], dict[str, Any]]]:
    """Kernel name -> (its source, argument types ({t}: the compute type), constants)."""
    out: dict[str, tuple[Kernel, list[str], dict[str, Any]]] = {}
    for module in (triton_attention, triton_paged, triton_dense):
        for name, (types, constants) in module.COMPILE_CASES.items():
            out[name] = (getattr(module, name), types, constants)
    return out


def compile_case(name: str, dtype: str, arch: int = 90) -> Any:
    """One kernel of `cases()` compiled for `arch` with `dtype` as its compute type, no GPU
    needed: Triton's compiled kernel (its `asm`: "ptx", "cubin"; its `metadata`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source, types, constants = cases()[name]
    kernel = source.jit
    args = [a for a in kernel.arg_names if a not in constants]
    if len(args) != len(types):
        raise ValueError(f"{name}: {len(args)} arguments, {len(types)} types")
    signature = {a: t.format(t=dtype) for a, t in zip(args, types, strict=True)}
    signature.update(dict.fromkeys(constants, "constexpr"))
    # what a launch specializes on for this shape: pointers 16-byte aligned, strides and split
    # lengths multiples of 16 (so loads go 16 bytes wide), but for the arguments that vary
    # from step to step, which the JIT leaves unspecialized
    varying = {*source.do_not_specialize, *source.do_not_specialize_on_alignment}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(kernel.arg_names)
        if (signature[a].startswith("*") or a.startswith("stride_") or a == "split_len")
        and a not in varying
    }
    ast = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(ast, target=GPUTarget("cuda", arch, 32), options=source.options)


def compile_report(
    arch: int = 90, dtypes: tuple[str, ...] = ("fp16", "bf16"), names: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Compile every kernel (or those `names`) for `arch` (sm_90: the H100 and H200) from its
    source, no GPU needed: per kernel and type, its registers, spills, shared memory, cubin
    size and float32 fused multiply-adds (where a kernel rounds products as torch does, the
    compiler must not contract them)."""
    out = []
    for name in names or tuple(cases()):
        for dtype in dtypes:
            compiled = compile_case(name, dtype, arch)
            cubin = compiled.asm["cubin"]
            out.append(
                {
                    "kernel": name,
                    "dtype": dtype,
                    "arch": f"sm_{arch}",
                    **_resource_usage(cubin),
                    "shared_bytes": compiled.metadata.shared,
                    "num_warps": compiled.metadata.num_warps,
                    "num_stages": compiled.metadata.num_stages,
                    "cubin_bytes": len(cubin),
                    "fma_f32": compiled.asm["ptx"].count("fma.rn.f32"),
                }
            )
    return out


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack and local memory (spills land there) of a cubin's kernel, read by
    the cuobjdump Triton ships with its NVIDIA backend."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {
        "registers": int(usage["REG"]),
        "stack_bytes": int(usage["STACK"]),
        "local_bytes": int(usage["LOCAL"]),
    }


def report_in_own_process(*argv: str) -> list[dict[str, Any]]:
    """`compile_report` with this module's command-line arguments, run in a process of its own
    without `TRITON_INTERPRET` (a process that runs Triton's interpreter cannot compile)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "engine.kernels.triton_compile", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"triton_compile {' '.join(argv)} failed: {done.stderr[-3000:]}")
    report: list[dict[str, Any]] = json.loads(done.stdout)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--arch", type=int, default=90, help="the compute capability x 10")
    parser.add_argument("--dtypes", default="fp16,bf16", help="compute types, comma-separated")
    parser.add_argument("--kernels", default="", help="kernel names, comma-separated (all)")
    args = parser.parse_args(argv)
    if not available():
        print("triton is not installed", file=sys.stderr)
        return 1
    names = tuple(n for n in args.kernels.split(",") if n)
    unknown = sorted(set(names) - set(cases()))
    if unknown:
        print(f"unknown kernels {unknown}; known: {sorted(cases())}", file=sys.stderr)
        return 2
    dtypes = tuple(args.dtypes.split(","))
    print(json.dumps(compile_report(args.arch, dtypes, names), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
