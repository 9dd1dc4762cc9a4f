"""Build mamba_ssm's CUDA selective scan (``selective_scan_cuda``) for the one GPU at hand.

mamba_ssm 2.3.2.post1's setup.py compiles this extension for nine architectures, which takes far
longer than a benchmark session can spend; the selective scan needs only its own sources. This
script compiles ``csrc/selective_scan`` from the sdist with ``torch.utils.cpp_extension`` for the
current device's architecture alone, with the nvcc flags setup.py uses, in parallel (ninja).

Usage (on the GPU box):
    python benchmarks/build_selective_scan_cuda.py mamba_ssm-2.3.2.post1.tar.gz BUILD_DIR

BUILD_DIR then holds ``selective_scan_cuda.so``. With that folder on the import path (the GPU
scripts add ``$SELECTIVE_SCAN_CUDA_DIR``), :func:`peers.mamba_ssm_selective_scan` gives mamba_ssm's
``selective_scan_fn`` running it. On the H100 box the build took 170 s on 16 cores (41.6 MB).
"""
import argparse
import os
import pathlib
import tarfile
import time

import torch
from torch.utils.cpp_extension import load

SOURCES = ["selective_scan.cpp"] + [f"selective_scan_fwd_{t}.cu" for t in ("fp32", "fp16", "bf16")] + [
    f"selective_scan_bwd_{t}_{kind}.cu" for t in ("fp32", "fp16", "bf16") for kind in ("real", "complex")]

# setup.py's nvcc flags, less its architecture list (the architecture comes from TORCH_CUDA_ARCH_LIST)
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-lineinfo"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("sdist", help="mamba_ssm-2.3.2.post1.tar.gz")
    parser.add_argument("build_dir")
    args = parser.parse_args()
    build = pathlib.Path(args.build_dir).resolve()
    build.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.sdist) as sdist:
        members = [m for m in sdist.getmembers() if "/csrc/selective_scan/" in m.name]
        sdist.extractall(build / "src", members=members, filter="data")
    csrc = next((build / "src").glob("*/csrc/selective_scan"))
    major, minor = torch.cuda.get_device_capability()
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))
    start = time.perf_counter()
    load(name="selective_scan_cuda", sources=[str(csrc / s) for s in SOURCES],
         extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=NVCC_FLAGS, extra_include_paths=[str(csrc)],
         build_directory=str(build), verbose=True)
    print(f"built selective_scan_cuda for sm_{major}{minor} in {time.perf_counter() - start:.0f} s "
          f"({torch.cuda.get_device_name()}) in {build}")


if __name__ == "__main__":
    main()
