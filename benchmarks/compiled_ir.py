"""What Triton compiles a kernel to for a Hopper GPU (sm_90), on a machine without a GPU: the TTGIR
of one specialization, and counts of what decides where its tiles live.

    python benchmarks/compiled_ir.py {chunk_state,bidirectional_chunk_states} [--packed] [--ttgir FILE]

A launch specializes a kernel on its arguments: an integer equal to 1 becomes a constant, and
integers divisible by 16 and 16-byte-aligned pointers are marked so. :func:`compile_for_hopper`
does the same from the values it is given, so the IR is the one a launch with those arguments gets
(before ptxas; a compile without those marks can look quite different). The counts:

* ``async_copies``: loads copied into shared memory by the asynchronous copy unit (cp.async), as
  the software pipeline issues them ahead of their use;
* ``shared_from_registers``: tiles stored to shared memory from registers (``local_alloc`` of a
  value), what a dot operand that was computed or selected after its load costs;
* ``selects`` and ``dots`` (warp-group matmuls).

It runs in a process of its own: it tells ``mamba_annotated`` that a GPU is present so that the
kernels are Triton functions to compile rather than to interpret; nothing is launched.
"""
import argparse
import json
import os
import re
import sys

import torch

# before triton and mamba_annotated are imported: compile, don't interpret (a parent process that
# runs the interpreter passes TRITON_INTERPRET=1 on)
os.environ["TRITON_INTERPRET"] = "0"
torch.cuda.is_available = lambda: True
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def jit_function(kernel):
    """The JITFunction under the package's launch and autotuning wrappers."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def compile_for_hopper(kernel, args: dict, num_warps: int = 4, num_stages: int = 3) -> str:
    """The TTGIR of ``kernel`` for ``args`` (every argument by name: a pointer as its type, e.g.
    "*bf16", an integer or a constexpr as its value), specialized as a launch would be."""
    fn = jit_function(kernel)
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        value = args[name]
        if index in fn.constexprs or isinstance(value, bool) or (not isinstance(value, str) and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]  # tensors come from PyTorch's 16-byte-aligned allocator
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=HOPPER, options=dict(num_warps=num_warps, num_stages=num_stages))
    return compiled.asm["ttgir"]


def summary(ttgir: str) -> dict:
    return dict(async_copies=len(re.findall(r"ttg\.async_copy_global_to_local", ttgir)),
                shared_from_registers=len(re.findall(r"ttg\.local_alloc %", ttgir)),
                selects=len(re.findall(r"arith\.select", ttgir)),
                dots=len(re.findall(r"ttng\.warp_group_dot ", ttgir)))


def chunk_state_case(packed: bool) -> str:
    """Chapter 5's chunk_state_kernel for the chunk states (TO_END) at the SSD benchmark's first
    shape, (4, 4096, 80 heads, 64, 128) bfloat16, contiguous, chunk 256, with the first tuned
    configuration (steps of 32, all of dstate, 4 warps, 4 stages)."""
    from mamba_annotated.ssd.chunk_state import chunk_state_kernel

    batch, length, heads, headdim, dstate, chunk = 4, 4096, 80, 64, 128, 256
    args = dict(u_ptr="*bf16", v_ptr="*bf16", dA_cumsum_ptr="*fp32", dt_ptr="*fp32", seq_idx_ptr="*i32",
                out_ptr="*fp32", length=length, heads=heads, groups=1, n_chunks=length // chunk, headdim=headdim,
                dstate=dstate, stride_u_b=length * heads * headdim, stride_u_l=heads * headdim, stride_u_h=headdim,
                stride_u_p=1, stride_v_b=length * dstate, stride_v_l=dstate, stride_v_g=dstate, stride_v_n=1,
                stride_seq_b=length, stride_seq_l=1, TO_END=True, HAS_SEQ_IDX=packed, CHUNK=chunk, BLOCK_P=64,
                BLOCK_N=dstate, BLOCK_K=32, PRECISION="tf32")
    return compile_for_hopper(chunk_state_kernel, args, num_warps=4, num_stages=4)


def bidirectional_chunk_states_case(packed: bool) -> str:
    """Chapter 6's chunk_states_kernel for the forward pass's two chunk states, at the same shape,
    the directions sharing B, with the first tuned configuration."""
    from mamba_annotated.bidirectional.chunk_states import chunk_states_kernel

    batch, length, heads, headdim, dstate, chunk = 4, 4096, 80, 64, 128, 256
    n_chunks = length // chunk
    b_strides = dict(b=length * dstate, l=dstate, g=dstate, n=1)
    args = dict(u_ptr="*bf16", v_ptr="*bf16", vr_ptr="*bf16", a_ptr="*fp32", dt_ptr="*fp32", b_ptr="*fp32",
                dtr_ptr="*fp32", A_ptr="*fp32", seq_idx_ptr="*i32", out_ptr="*fp32", length=length, heads=heads,
                groups=1, n_chunks=n_chunks, headdim=headdim, dstate=dstate,
                direction_size=batch * n_chunks * heads * headdim * dstate,
                stride_u_b=length * heads * headdim, stride_u_l=heads * headdim, stride_u_h=headdim, stride_u_p=1,
                **{f"stride_v_{k}": v for k, v in b_strides.items()},
                **{f"stride_vr_{k}": v for k, v in b_strides.items()},
                stride_seq_b=length, stride_seq_l=1, GRAD=False, SHIFT=0, OFFSET=0, SHARED_V=True,
                HAS_SEQ_IDX=packed, CHUNK=chunk, BLOCK_P=64, BLOCK_N=dstate, BLOCK_K=32, PRECISION="tf32")
    return compile_for_hopper(chunk_states_kernel, args, num_warps=4, num_stages=4)


CASES = {"chunk_state": chunk_state_case, "bidirectional_chunk_states": bidirectional_chunk_states_case}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--packed", action="store_true", help="with seq_idx")
    parser.add_argument("--ttgir", help="write the TTGIR here")
    args = parser.parse_args()
    ttgir = CASES[args.case](args.packed)
    if args.ttgir:
        with open(args.ttgir, "w") as out:
            out.write(ttgir)
    print(f"{args.case}{' packed' if args.packed else ''}, Triton {triton.__version__}, sm_90")
    print("counts:", json.dumps(summary(ttgir)))
    for line in ttgir.splitlines():
        if re.search(r"ttg\.local_alloc %", line):
            print("  from registers:", line.strip()[:160])


if __name__ == "__main__":
    sys.exit(main())
