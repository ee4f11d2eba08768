"""The grouped block-FP8 GEMM of csrc/grouped_fp8_gemm_sm90.cu (CUTLASS's pointer-array kernel with blockwise
scaling, for Hopper), compiled with nvcc on first use against the CUTLASS headers flashinfer ships, and called by
ctypes: routed experts at prefill sizes, where it keeps the tensor cores busy while each K block's partial sums are
scaled, which our Triton kernel cannot.

Built once per source and toolkit into ~/.cache/pdserve/kernels (PDSERVE_KERNEL_CACHE overrides), by the CUDA
toolkit's nvcc or a pip-installed one (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-cccl, with a host C++ compiler);
CUDA's runtime is linked in statically and the driver is reached through the runtime, so the library needs nothing
else. Where it cannot be built (no nvcc, no flashinfer) or run (not SM90), `available()` is False and callers keep
the Triton kernel; the project's CUDA image has no nvcc, so it serves the Triton kernel.
"""

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.ops.fp8_gemm import is_sm90

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "grouped_fp8_gemm_sm90.cu"
SCALE_BLOCK = 128
NVCC_FLAGS = ("-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DNDEBUG", "-diag-suppress", "20012",
              "-Xcompiler", "-fPIC", "-shared")


def _nvcc() -> str | None:
    """The toolkit's nvcc (torch's CUDA_HOME, then PATH), else one from NVIDIA's pip wheels (nvidia/cu13/bin)."""
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [Path(CUDA_HOME) / "bin" / "nvcc"] if CUDA_HOME else []
    found = shutil.which("nvcc")
    candidates += [Path(found)] if found else []
    wheels = importlib.util.find_spec("nvidia")
    for root in (wheels.submodule_search_locations or []) if wheels else []:
        candidates += sorted(Path(root).glob("cu*/bin/nvcc"), reverse=True)
    return next((str(path) for path in candidates if path.exists()), None)


def _cutlass_includes() -> list[Path] | None:
    """CUTLASS's headers as flashinfer's wheel carries them (for its own JIT)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent / "data" / "cutlass"
    includes = [root / "include", root / "tools" / "util" / "include"]
    return includes if all(path.is_dir() for path in includes) else None


def _build(nvcc: str, includes: list[Path]) -> Path:
    """The library for this source, toolkit and headers: from the cache, or compiled into it. Processes that start
    together (an expert-parallel instance's ranks on one host) take a file lock, so one compiles and the rest load
    its library instead of running several CUTLASS compiles at once."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(map(str, includes)).encode()
                         + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pdserve" / "kernels"))
    library = cache / f"grouped_fp8_gemm_sm90-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built by the process that held the lock
            return library
        log.info("compiling the grouped FP8 GEMM (CUTLASS, sm_90a) with %s: about a minute, once", nvcc)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            partial = Path(scratch) / library.name
            # The static runtime's directory: the toolkit's lib64, a wheel's lib (which nvcc.profile does not name).
            toolkit = Path(nvcc).parent.parent
            command = [nvcc, *NVCC_FLAGS, *(f"-I{path}" for path in includes), f"-L{toolkit / 'lib'}",
                       f"-L{toolkit / 'lib64'}", str(SOURCE), "-o", str(partial)]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
            partial.replace(library)  # atomic: a process that skips the lock sees the whole file or none
    log.info("compiled %s", library)
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    nvcc, includes = _nvcc(), _cutlass_includes()
    if nvcc is None or includes is None:
        log.info("the CUTLASS grouped FP8 GEMM is not built: %s", "no nvcc" if nvcc is None else "no flashinfer")
        return None
    try:
        library = ctypes.CDLL(str(_build(nvcc, includes)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or ""
        log.warning("the CUTLASS grouped FP8 GEMM did not build, the Triton kernel serves: %s %s", error,
                    detail[-2000:])
        return None
    library.pdserve_grouped_fp8_gemm_workspace.restype = ctypes.c_size_t
    library.pdserve_grouped_fp8_gemm_workspace.argtypes = [ctypes.c_int] * 6
    library.pdserve_grouped_fp8_gemm.restype = ctypes.c_int
    library.pdserve_grouped_fp8_gemm.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return library


def available(device: torch.device) -> bool:
    """Whether the kernel runs here: an SM90 GPU and a built library (building it on the first call)."""
    return device.type == "cuda" and is_sm90(device) and _library() is not None


def takes(values: torch.Tensor, block_size: tuple[int, int]) -> bool:
    """Shapes the kernel takes: stacked [groups, N, K] weights, contiguous, in 128 x 128 blocks, N and K whole
    blocks."""
    if values.dim() != 3 or not values.is_contiguous() or block_size != (SCALE_BLOCK, SCALE_BLOCK):
        return False
    return values.shape[1] % SCALE_BLOCK == 0 and values.shape[2] % SCALE_BLOCK == 0


def serves(values: torch.Tensor, block_size: tuple[int, int], device: torch.device) -> bool:
    """Whether the kernel serves a grouped product of these weights here: takes() and available()."""
    return takes(values, block_size) and available(device)


def grouped_fp8_gemm(q: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor,
                     group_ends: torch.Tensor) -> torch.Tensor:
    """q [rows, K] FP8 sorted by group with quantize_rows()'s scales [K/128, >= rows]; values [groups, N, K] FP8
    with scale_inv [groups, N/128, K/128]; group_ends [groups] int32 -> [rows, N] bf16. available() and takes()
    must hold."""
    library = _library()
    if not (q.is_contiguous() and scale_inv.is_contiguous() and scales.stride(1) == 1):
        raise ValueError("the CUTLASS grouped FP8 GEMM takes contiguous rows and weight scales, rows' scales by row")
    rows, k = q.shape
    groups, n, _ = values.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=q.device)
    if rows == 0:
        return out
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    sm_count = _sm_count(device)
    workspace = torch.empty(library.pdserve_grouped_fp8_gemm_workspace(groups, rows, n, k, device, sm_count),
                            dtype=torch.uint8, device=q.device)
    status = library.pdserve_grouped_fp8_gemm(
        q.data_ptr(), scales.data_ptr(), scales.stride(0), values.data_ptr(), scale_inv.data_ptr(),
        group_ends.data_ptr(), out.data_ptr(), groups, rows, n, k, workspace.data_ptr(), workspace.numel(), device,
        sm_count, torch.cuda.current_stream(q.device).cuda_stream)
    if status != 0:
        raise RuntimeError(f"the CUTLASS grouped FP8 GEMM failed (status {status}) on {rows} rows x {n} x {k}")
    return out


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
