"""Compile the hot kernels for an H100/H200 (sm_90) on a machine without a GPU, and report what each
compiled kernel uses: registers, spill stack, shared memory.

Device time is scarce and a kernel that fails to compile on the GPU's Triton, or that spills, wastes
a call. Triton's compiler and its ptxas run without a GPU, so both can be checked here first:

    pip download triton==3.6.0 --no-deps -d /tmp/wheels        # the GPU's Triton version
    unzip -q -o /tmp/wheels/triton-3.6.0-*.whl -d /tmp/triton36
    PYTHONPATH=/tmp/triton36 python scripts/compile_offline.py attention ssd

Without the PYTHONPATH it compiles with the installed Triton. Each kernel is compiled at the
configurations its launcher uses on the GPU (attention: ``forward_config``; SSD ``chunk_scan``: every
autotuned configuration, and its checked kernel, plain, with ``seq_idx`` and gated with D and z).
STACK > 0 means ptxas spilled registers to local memory; compare it before and after a change
(``--json`` keeps the report). The numbers are the compiler's, not measurements: speed still needs
the GPU.

The ``scores`` family compiles the bidirectional scores kernel as the launcher launches it (its
arguments specialized by Triton's own binder: an integer equal to 1 becomes a constant, pointers
and integers divisible by 16 are marked so) for the configurations the H100 runs of issue 14 found
right or wrong with a time-major B' (README, "Using the kernels"), and prints each cubin's hash:
which of them are one binary.

The ``states`` family compiles the two chunk-state kernels (chapter 5's ``chunk_state``, chapter 6's
``chunk_states``) as launched at the SSD benchmark's first shape, with and without ``seq_idx``, at
their first tuned configuration. The ``backward`` family compiles the kernels of both chapters'
backward passes that read dy with x (the dx kernels and their checked second launches, the dCB/dG
and dB/dC kernels), as launched, with and without ``seq_idx``.
The ``outputs`` family compiles chapter 6's output kernel as launched, with and without the shift,
D and ``seq_idx``. The ``selective`` family compiles chapter 4.9's selective-scan forward and backward
kernels as launched, plain and with Mamba's D, z, delta_bias and softplus. The ``in_projection``
family compiles the convolution's and the gated norm's kernels as a Mamba-2 block launches them on
slices of its in-projection output, whose row stride or channel count 16 may not divide.
For every kernel compiled, the report also counts in its TTGIR
where its tiles go: ``tile_async_copies``, the asynchronous copies of 2-d tiles into shared memory (with
num_stages s, a tile the pipeline fetches s - 1 steps ahead is copied s times in the IR, s - 1 before
the loop and once in it; one that waits on a load of its own step, fewer times), and
``shared_from_registers``, tiles stored to shared memory from registers (what a dot operand that
was selected or scaled after its load costs).
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before the package is imported: real JIT functions, not interpreted
import torch  # noqa: E402

torch.cuda.is_available = lambda: True  # the package then plans for a GPU (nothing is launched)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
TARGET = GPUTarget("cuda", 90, 32)


def unwrapped(kernel, kind):
    """The first object of type ``kind`` in ``kernel`` and its wrappers (a LeanLaunch, an Autotuner)."""
    while not isinstance(kernel, kind):
        kernel = getattr(kernel, "kernel", None) or kernel.fn
    return kernel


def jit_function(kernel):
    """The JITFunction under a LeanLaunch and/or an Autotuner."""
    return unwrapped(kernel, triton.JITFunction)


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK and SHARED of a cubin, from the cuobjdump that ships with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in (field.split(":") for field in line.split() if field.split(":")[0] in
                                   ("REG", "STACK", "SHARED"))}


def usage(compiled) -> dict:
    """Resource usage, Triton's shared memory and the cubin's hash (equal hashes: one binary)."""
    cubin = compiled.asm["cubin"]
    return dict(resource_usage(cubin), triton_shared=compiled.metadata.shared,
                cubin_md5=hashlib.md5(cubin).hexdigest()[:8])


def tile_counts(compiled) -> dict:
    """Where a compiled kernel's tiles go, from its TTGIR (module docstring)."""
    ttgir = compiled.asm["ttgir"]
    return dict(tile_async_copies=len(re.findall(r"ttg\.async_copy_global_to_local .*tensor<\d+x\d+x", ttgir)),
                shared_from_registers=len(re.findall(r"ttg\.local_alloc %", ttgir)),
                shared_allocations=len(re.findall(r"ttg\.local_alloc", ttgir)),
                dots=len(re.findall(r"ttng\.warp_group_dot ", ttgir)))


def global_loads(compiled) -> dict:
    """The loads from global memory in a compiled kernel's PTX: ``load_widths`` counts them by vector
    width and element size ("b16": one 16-bit element, "v4.b32": four 32-bit words...), and
    ``scalar_16bit_loads`` is its "b16" count (what a row stride the compiler cannot prove aligned
    costs a bfloat16 tile)."""
    widths = {}
    for width in re.findall(r"ld\.global(?:\.(?!v\d)[\w:]+)*\.((?:v\d\.)?[bfsu]\d+)\b", compiled.asm["ptx"]):
        widths[width] = widths.get(width, 0) + 1
    return dict(load_widths=widths, scalar_16bit_loads=widths.get("b16", 0) + widths.get("u16", 0))


def compile_kernel(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Compile ``kernel`` for sm_90: parameters named in ``constexprs`` take those values, the others
    the type in ``types`` (default i32)."""
    fn = jit_function(kernel)
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "i32") for p in fn.params}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


class LaunchRecorder:
    """Stands in for a kernel: keeps the arguments of each launch instead of launching, and answers
    for the kernel otherwise (a launcher may read its autotuner's configurations)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def launched_arguments(module, kernel_name: str, launcher, *inputs, **options):
    """The (args, kwargs) that ``launcher(*inputs, **options)`` passes to ``module.kernel_name``."""
    return launches_of(module, (kernel_name,), launcher, *inputs, **options)[kernel_name][0]


def launches_of(module, kernel_names, launcher, *inputs, **options) -> dict:
    """{name: [(args, kwargs) of each launch]} of ``module``'s kernels ``kernel_names`` in
    ``launcher(*inputs, **options)``, which must launch no other kernel."""
    kernels = {name: getattr(module, name) for name in kernel_names}
    recorders = {name: LaunchRecorder(kernel) for name, kernel in kernels.items()}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        launcher(*inputs, **options)
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    return {name: recorder.launches for name, recorder in recorders.items()}


def compile_as_launched(kernel, args, kwargs):
    """Compile for sm_90 what ``kernel[grid](*args, **kwargs)`` would compile, its arguments
    specialized by Triton's binder (Triton 3.6's internal interface, as its JIT calls it)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = jit_function(kernel)
    backend = make_backend(TARGET)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def attention_cases():
    from mamba_annotated.attention.forward import attention_fwd_kernel, forward_config

    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "lse_ptr": "*fp32", "alibi_ptr": "*fp32", "seed_ptr": "*i64", "cu_seqlens_q_ptr": "*i32",
        "cu_seqlens_k_ptr": "*i32", "qk_scale": "fp32", "cap2": "fp32", "dropout_p": "fp32"}
    for head_dim in (64, 128):
        cfg = forward_config(head_dim, torch.bfloat16)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        for varlen in (False, True):  # packed sequences (attention_varlen): lengths masked, never even
            for causal in (False, True):
                constexprs = dict(VARLEN=varlen, WINDOW_LEFT=False, WINDOW_RIGHT=causal, SOFTCAP=0, ALIBI=False,
                                  DROPOUT=False, SCALE_FIRST=False, EVEN_M=not varlen, EVEN_N=not varlen,
                                  EVEN_D=True, PRECISION="tf32", BLOCK_D=head_dim, **cfg)
                name = f"attention_fwd_kernel d{head_dim} {'causal' if causal else 'full'}{' varlen' if varlen else ''}"
                yield (name,
                       lambda constexprs=constexprs, warps=warps, stages=stages: compile_kernel(
                           attention_fwd_kernel, types, constexprs, warps, stages))


def ssd_cases():
    from mamba_annotated.ssd import chunk_scan as module

    types = {n: "*bf16" for n in ("x_ptr", "z_ptr", "C_ptr", "out_ptr", "y_ptr", "H_ptr")} | {
        n: "*fp32" for n in ("CB_ptr", "dA_cumsum_ptr", "dt_ptr", "D_ptr")} | {
        "seq_idx_ptr": "*i32", "flags_ptr": "*i8"}
    # plain and packed as the SSD benchmark launches them (D, no gate), and gated as a Mamba-2 block
    # launches it (D and z, one sequence)
    for tag, packed, gated in (("plain", False, False), ("seq_idx", True, False), ("gated", False, True)):
        options = dict(HAS_D=True, D_PER_CHANNEL=False, HAS_Z=gated, HAS_SEQ_IDX=packed, CHUNK=256, PRECISION="tf32")
        for cfg in module.CONFIGS:
            name = f"chunk_scan_kernel {tag} " + " ".join(f"{k}={v}" for k, v in cfg.kwargs.items())
            yield (f"{name} w{cfg.num_warps} s{cfg.num_stages}",
                   lambda cfg=cfg, options=options: compile_kernel(
                       module.chunk_scan_kernel, types, options | cfg.kwargs, cfg.num_warps, cfg.num_stages))
        checked = module.checked_config(256)
        warps, stages = checked.pop("num_warps"), checked.pop("num_stages")
        yield (f"chunk_scan_checked_kernel {tag}",
               lambda options=options, checked=checked, warps=warps, stages=stages: compile_kernel(
                   module.chunk_scan_checked_kernel, types, options | checked, warps, stages))


# (length, dstate, chunk, B' layout, num_warps, what the H100 computed): the configurations issue 14's
# runs narrowed the wrong scores to (README, "Using the kernels")
SCORES_RUNS = [(1021, 100, 32, "time major", 4, "wrong"), (1000, 100, 32, "time major", 4, "wrong"),
               (257, 100, 32, "time major", 4, "wrong"), (61, 100, 32, "time major", 4, "wrong"),
               (1021, 40, 32, "time major", 4, "wrong"), (1021, 200, 32, "time major", 4, "wrong"),
               (1008, 100, 32, "time major", 4, "right"), (1024, 100, 32, "time major", 4, "right"),
               (512, 100, 32, "time major", 4, "right"), (1021, 16, 32, "time major", 4, "right"),
               (1021, 64, 32, "time major", 4, "right"), (1021, 128, 32, "time major", 4, "right"),
               (1021, 100, 64, "time major", 4, "right"), (1021, 100, 128, "time major", 4, "right"),
               (1021, 100, 32, "time major", 2, "right"), (1021, 100, 32, "time major", 8, "right"),
               (1021, 100, 32, "contiguous", 4, "right")]


def scores_cases():
    from mamba_annotated.bidirectional import chunk_scores as module

    for length, dstate, chunk, layout, warps, seen in SCORES_RUNS:
        C, B, C_rev = (torch.empty(1, length, 1, dstate, dtype=torch.bfloat16) for _ in range(3))
        B_rev = torch.empty(1, dstate, 1, length, dtype=torch.bfloat16).permute(0, 3, 2, 1)  # strides (., 1, L, L)
        if layout == "contiguous":
            B_rev = B_rev.contiguous()
        args, kwargs = launched_arguments(module, "chunk_scores_kernel", module.chunk_scores, C, B, C_rev, B_rev,
                                          chunk, shift=False)
        yield (f"chunk_scores_kernel L={length} dstate={dstate} chunk={chunk} B' {layout} w{warps} (H100: {seen})",
               lambda args=args, kwargs=kwargs, warps=warps: compile_as_launched(
                   module.chunk_scores_kernel, args, dict(kwargs, num_warps=warps)))


def states_cases():
    """(name, compile) of the two chunk-state kernels at (4, 4096, 80 heads, 64, 128) bfloat16, chunk
    256, one group, as their launchers launch them, at each kernel's first tuned configuration."""
    from mamba_annotated.bidirectional import chunk_states as bidirectional
    from mamba_annotated.ssd import chunk_state as ssd

    batch, length, heads, headdim, dstate, chunk = 4, 4096, 80, 64, 128, 256
    n_chunks = length // chunk
    x = torch.empty(batch, length, heads, headdim, dtype=torch.bfloat16)
    B = torch.empty(batch, length, 1, dstate, dtype=torch.bfloat16)
    sums, steps = torch.empty(batch, heads, n_chunks, 2, chunk), torch.empty(batch, heads, n_chunks, chunk)
    A = torch.empty(heads)
    for packed in (False, True):
        seq_idx = torch.zeros(batch, length, dtype=torch.int32) if packed else None
        tag = "seq_idx" if packed else "plain"
        for name, module, launcher, inputs, options in (
                ("chunk_state_kernel", ssd, ssd.chunk_state, (x, B, sums, steps), dict(to_end=True)),
                ("chunk_states_kernel", bidirectional, bidirectional.chunk_states,
                 (x, B, B, steps, steps, steps, steps, A), {})):
            args, kwargs = launched_arguments(module, name, launcher, *inputs, seq_idx=seq_idx, **options)
            # the first tuned configuration (for chunk_state the tuner's pick on an H200, its comment says)
            config = unwrapped(getattr(module, name), triton.runtime.Autotuner).configs[0]
            yield (f"{name} {tag}", lambda module=module, name=name, args=args, kwargs=kwargs, config=config:
                   compile_as_launched(getattr(module, name), args, dict(kwargs, **config.all_kwargs())))


def first_tuned_kwargs(kernel) -> dict:
    """The first autotuned configuration's keyword arguments of ``kernel`` ({} where it is not tuned)."""
    while not isinstance(kernel, triton.JITFunction):
        if isinstance(kernel, triton.runtime.Autotuner):
            return kernel.configs[0].all_kwargs()
        kernel = getattr(kernel, "kernel", None) or kernel.fn
    return {}


def backward_cases():
    """(name, compile) of the kernels of chapter 5's and chapter 6's backward passes that read dy
    with x (the dx kernels and their checked second launches, the dCB/dG kernels, the dB/dC
    kernels), at (2, 1024, 8 heads, 64, 128) bfloat16, chunk 256, one group, as their launchers
    launch them (tuned kernels at their first configuration), with and without seq_idx."""
    from mamba_annotated.bidirectional import chunk_scan_bwd as bidirectional
    from mamba_annotated.ssd import chunk_scan_bwd as ssd
    from mamba_annotated.ssd.chunk_state import cb_length

    batch, length, heads, headdim, dstate, chunk = 2, 1024, 8, 64, 128, 256
    n_chunks = length // chunk
    x = torch.empty(batch, length, heads, headdim, dtype=torch.bfloat16)
    B = torch.empty(batch, length, 1, dstate, dtype=torch.bfloat16)
    dS = torch.empty(batch, n_chunks, heads, headdim, dstate, dtype=torch.bfloat16)
    scores, diagonal = torch.empty(batch, n_chunks, 1, chunk, chunk), torch.empty(batch, n_chunks, 1, chunk)
    CB = torch.empty(batch, n_chunks, 1, cb_length(chunk))  # chapter 5's squares; chapter 6's scores are whole
    sums, steps = torch.empty(batch, heads, n_chunks, 2, chunk), torch.empty(batch, heads, n_chunks, chunk)
    A, D = torch.empty(heads), torch.empty(heads)
    dx_kernels = ("chunk_scan_bwd_dx_kernel", "chunk_scan_bwd_dx_checked_kernel")
    for packed in (False, True):
        seq_idx = torch.zeros(batch, length, dtype=torch.int32) if packed else None
        tag = "seq_idx" if packed else "plain"
        for chapter, module, dx_inputs, dbc_inputs, dbc_kernels in (
                ("ssd", ssd, (CB, x, x, B, dS, sums, steps), (x, x, B, B, CB, dS, dS, sums, steps),
                 ("chunk_scan_bwd_dcb_kernel", "chunk_scan_bwd_dbc_kernel", "chunk_scan_bwd_dbc_checked_kernel")),
                ("bidirectional", bidirectional, (scores, diagonal, x, x, B, B, dS, dS, steps, steps, steps, steps, A),
                 (x, x, B, B, B, B, scores, dS, dS, dS, dS, steps, steps, steps, steps, A),
                 ("chunk_scan_bwd_dscores_kernel", "chunk_scan_bwd_dbc_kernel", "chunk_scan_bwd_dbc_checked_kernel"))):
            launches = launches_of(module, dx_kernels, module.chunk_scan_bwd_dx, *dx_inputs, D=D, seq_idx=seq_idx)
            launches.update(launches_of(module, dbc_kernels, module.chunk_scan_bwd_dbc, *dbc_inputs, seq_idx=seq_idx))
            for name, calls in launches.items():
                for i, (args, kwargs) in enumerate(calls):  # the dG kernel: its diagonal and off-diagonal launches
                    kernel = getattr(module, name)
                    yield (f"{chapter} {name}{' ' + str(i) if len(calls) > 1 else ''} {tag}",
                           lambda kernel=kernel, args=args, kwargs=dict(kwargs, **first_tuned_kwargs(kernel)):
                           compile_as_launched(kernel, args, kwargs))


def outputs_cases():
    """(name, compile) of chapter 6's output kernel at (2, 1024, 8 heads, 64, 128) bfloat16, chunk
    256, one group, as its launcher launches it at its first tuned configuration: with and without
    the shift, D and seq_idx (which decide which of its x tiles it checks)."""
    from mamba_annotated.bidirectional import chunk_outputs as module

    batch, length, heads, headdim, dstate, chunk = 2, 1024, 8, 64, 128, 256
    n_chunks = length // chunk
    x = torch.empty(batch, length, heads, headdim, dtype=torch.bfloat16)
    C = torch.empty(batch, length, 1, dstate, dtype=torch.bfloat16)
    G, Gd = torch.empty(batch, n_chunks, 1, chunk, chunk), torch.empty(batch, n_chunks, 1, chunk)
    H = torch.empty(batch, n_chunks, heads, headdim, dstate, dtype=torch.bfloat16)
    steps, A, D = torch.empty(batch, heads, n_chunks, chunk), torch.empty(heads), torch.empty(heads)
    config = unwrapped(module.chunk_outputs_kernel, triton.runtime.Autotuner).configs[0].all_kwargs()
    for shift in (False, True):
        for with_D in (False, True):
            for packed in (False, True):
                seq_idx = torch.zeros(batch, length, dtype=torch.int32) if packed else None
                args, kwargs = launched_arguments(module, "chunk_outputs_kernel", module.chunk_outputs, G,
                                                  None if shift else Gd, x, C, C, H, H, steps, steps, steps, steps, A,
                                                  D=D if with_D else None, seq_idx=seq_idx, shift=shift)
                name = (f"chunk_outputs_kernel shift={shift} D={'yes' if with_D else 'no'} "
                        f"{'seq_idx' if packed else 'plain'}")
                yield (name, lambda args=args, kwargs=kwargs: compile_as_launched(
                    module.chunk_outputs_kernel, args, dict(kwargs, **config)))


def selective_cases():
    """(name, compile) of chapter 4.9's selective-scan kernels at bench_selective_scan_cuda.py's
    "Mamba-130M training" shape in bfloat16 ((16, 1536, 2048), N = 16, one group), as their launchers
    launch them, with and without D, z and delta_bias (softplus on where delta_bias is given, as
    Mamba calls it)."""
    from mamba_annotated.scan import selective as module

    batch, dim, length, dstate = 16, 1536, 2048, 16
    u = torch.empty(batch, dim, length, dtype=torch.bfloat16)
    A, D, bias = torch.empty(dim, dstate), torch.empty(dim), torch.empty(dim)
    B = torch.empty(batch, 1, dstate, length, dtype=torch.bfloat16)
    chunk_states = torch.empty(module.chunk_states_shape(batch, dim, dstate, length))
    for gated in (False, True):
        options = dict(D=D, z=u, delta_bias=bias, delta_softplus=True) if gated else \
            dict(D=None, z=None, delta_bias=None, delta_softplus=False)
        inputs = (u, u, A, B, B, options["D"], options["z"], options["delta_bias"])
        tag = "D, z, delta_bias, softplus" if gated else "plain"
        forward = launched_arguments(module, "selective_scan_fwd_kernel", module.selective_scan_forward, *inputs,
                                     delta_softplus=options["delta_softplus"], store_chunk_states=True)
        # the backward launcher launches the partial sums' kernel too: recorded, not compiled
        backward = launches_of(module, ("selective_scan_bwd_kernel", "sum_group_partials_kernel"),
                               module.selective_scan_backward, *inputs, delta_softplus=options["delta_softplus"],
                               chunk_states=chunk_states, grad_y=u, grad_last_state=None)["selective_scan_bwd_kernel"][0]
        for name, (args, kwargs) in (("selective_scan_fwd_kernel", forward), ("selective_scan_bwd_kernel", backward)):
            yield (f"{name} {tag}", lambda name=name, args=args, kwargs=kwargs: compile_as_launched(
                getattr(module, name), args, kwargs))


def in_projection_cases():
    """(name, compile) of the kernels that read a Mamba-2 block's in-projection output through its
    row stride, as their launchers launch them at bench_models.py's model width (d_inner 1536, one
    group), batch 2 x 512, bfloat16: the convolution's three kernels on the xBC slice (causal, SiLU,
    bias) and the gated norm's two on the z slice (Mamba-2's default: the gate after the norm). Each
    at three layouts, rows 2 d_inner + 2 d_state + heads wide: "rows 3352" (state 128, 24 heads: 8
    divides the row stride and 16 does not, the benchmark's model), "rows 3360" (32 heads: 16
    divides it) and "channels 1800" (state 132: 8 divides the channel count and 16 does not)."""
    from mamba_annotated import conv1d, gated_norm

    batch, length, d_inner, width = 2, 512, 1536, 4
    for tag, dstate, heads in (("rows 3352", 128, 24), ("rows 3360", 128, 32), ("channels 1800", 132, 24)):
        zxbcdt = torch.empty(batch, length, 2 * d_inner + 2 * dstate + heads, dtype=torch.bfloat16)
        z, xBC = zxbcdt[..., :d_inner], zxbcdt[..., d_inner:2 * d_inner + 2 * dstate]
        channels = xBC.shape[-1]
        x, weight, bias = xBC.transpose(1, 2), torch.empty(channels, width), torch.empty(channels)
        d_out = torch.empty(batch, length, channels, dtype=torch.bfloat16).transpose(1, 2)  # the blocks' layout
        launches = launches_of(conv1d, ("depthwise_conv_fwd_kernel",), conv1d.conv_forward, x, weight, bias, None,
                               width - 1, True)
        launches.update(launches_of(conv1d, ("depthwise_conv_bwd_pre_kernel", "depthwise_conv_bwd_x_kernel"),
                                    conv1d.conv_backward, x, weight, bias, None, width - 1, True, d_out))
        y, norm_weight = torch.empty(batch, length, d_inner, dtype=torch.bfloat16), torch.empty(d_inner)
        rstd = torch.empty(batch * length, 1)
        launches.update(launches_of(gated_norm, ("gated_rms_norm_fwd_kernel",), gated_norm.gated_rms_norm_forward,
                                    y, norm_weight, None, z, 1e-5, d_inner, False))
        sm_count = gated_norm.sm_count
        gated_norm.sm_count = lambda: 132  # an H100's: the launcher sizes its bands by it (nothing is launched)
        try:
            launches.update(launches_of(gated_norm, ("gated_rms_norm_bwd_kernel",),
                                        gated_norm.gated_rms_norm_backward, y, norm_weight, None, z, rstd, 1e-5,
                                        d_inner, False, y))
        finally:
            gated_norm.sm_count = sm_count
        for name, ((args, kwargs),) in launches.items():
            module = conv1d if name.startswith("depthwise") else gated_norm
            yield (f"{name} {tag}", lambda module=module, name=name, args=args, kwargs=kwargs: compile_as_launched(
                getattr(module, name), args, kwargs))


FAMILIES = {"attention": attention_cases, "ssd": ssd_cases, "scores": scores_cases, "states": states_cases,
            "backward": backward_cases, "outputs": outputs_cases, "selective": selective_cases,
            "in_projection": in_projection_cases}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    parser.add_argument("--first", action="store_true", help="only the first configuration of each family")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; choose from {sorted(FAMILIES)}")
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}")
    report = {}
    for family in args.families:
        for i, (name, compile_case) in enumerate(FAMILIES[family]()):
            if args.first and i:
                break
            compiled = compile_case()
            report[name] = found = dict(usage(compiled), **tile_counts(compiled), **global_loads(compiled))
            print(f"{name:<80} REG {found['REG']:>3}  STACK {found['STACK']:>5}  shared {found['triton_shared']:>6}  "
                  f"cubin {found['cubin_md5']}  tile copies {found['tile_async_copies']:>2}  "
                  f"stored from registers {found['shared_from_registers']}  16-bit scalar loads "
                  f"{found['scalar_16bit_loads']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(triton=triton.__version__, kernels=report), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
