"""Every CUDA kernel compiles, on a machine without a GPU.

Twice per target (sm_80, sm_90): through NVRTC with the options CuPy's
RawModule gives it at run time, and through `nvcc --ptx`. Either must finish
with an empty log: a warning fails the test like an error does. On a GPU host
(marked gpu, skipped elsewhere) every kernel also loads through CuPy for the
device's own architecture and one tiny launch writes KV. Numerics are checked
on a GPU in test_kernels_gpu.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import resources

import pytest
import torch

from kvtierd.kernels import cuda_backend

ARCHS = ("80", "90")
FILES = sorted(cuda_backend.KERNEL_FILES)
CUDA_DIR = resources.files("kvtierd.kernels") / "cuda"


@pytest.fixture(scope="module")
def nvrtc():
    """cupy's NVRTC binding with libnvrtc loaded; skipped only when one of them is not installed."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as e:
        pytest.skip(f"cupy is not installed ({e}); install the 'cuda' extra")
    try:
        nvrtc.getVersion()  # loads libnvrtc (cupy finds the nvidia-cuda-nvrtc wheel's copy)
    except RuntimeError as e:
        pytest.skip(f"libnvrtc is not installed ({e}); install 'nvidia-cuda-nvrtc==13.0.*'")
    return nvrtc


def rawmodule_options(arch: str) -> tuple[str, ...]:
    """What RawModule passes to NVRTC on an sm_<arch> device (cupy/cuda/compiler.py, CuPy 14):
    our options plus CuPy's include paths and C++ standard, then -ftz=true, then the
    target and --device-as-default-execution-space. (--pch is off unless CUPY_NVRTC_USE_PCH.)"""
    from cupy._core.core import assemble_cupy_compiler_options

    options = assemble_cupy_compiler_options(cuda_backend.COMPILE_OPTIONS)
    return (*options, "-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space")


def bare_options(arch: str) -> tuple[str, ...]:
    """No include paths at all: the kernels must not need CUDA headers (pip-only hosts lack them)."""
    return (*cuda_backend.COMPILE_OPTIONS, f"-arch=sm_{arch}")


@pytest.mark.parametrize("options", [rawmodule_options, bare_options], ids=["rawmodule", "bare"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", FILES)
def test_nvrtc_compiles_cleanly(nvrtc, filename, arch, options):
    source = cuda_backend.load_source(filename)
    program = nvrtc.createProgram(source, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(program, options(arch))
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC failed on {filename} for sm_{arch}:\n{nvrtc.getProgramLog(program)}")
        log = nvrtc.getProgramLog(program)
        assert not log.strip(), f"NVRTC warned on {filename} for sm_{arch}:\n{log}"
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    missing = [name for name in cuda_backend.KERNEL_FILES[filename] if name.encode() + b"\0" not in cubin]
    assert not missing, f"{filename} does not define {missing}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", FILES)
def test_nvcc_ptx_compiles_cleanly(filename, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed (no CUDA toolkit on PATH)")
    ptx = tmp_path / "out.ptx"
    with resources.as_file(CUDA_DIR / filename) as source:
        command = [nvcc, "--ptx", f"-arch=sm_{arch}", "-std=c++17", "-Werror", "all-warnings", "-o", str(ptx), str(source)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, f"nvcc on {filename} for sm_{arch}:\n{output}"
    entries = set(re.findall(r"^\.visible \.entry (\w+)\(", ptx.read_text(), re.MULTILINE))
    assert entries == set(cuda_backend.KERNEL_FILES[filename])


def test_every_source_is_listed():
    on_disk = {entry.name for entry in CUDA_DIR.iterdir() if entry.name.endswith(".cu")}
    assert on_disk == set(cuda_backend.KERNEL_FILES)


def test_load_source_inlines_local_headers():
    # CuPy keys its binary cache on the source text, so headers must be part of it;
    # `#line` keeps NVRTC's messages pointing at the original file and line.
    for filename in FILES:
        original = (CUDA_DIR / filename).read_text().splitlines()
        lines = cuda_backend.load_source(filename).splitlines()
        assert not any(line.startswith('#include "') for line in lines)
        marks = [i for i, line in enumerate(lines) if line.endswith(f'"{filename}"') and line.startswith("#line ")]
        assert len(marks) == 1
        resumes_at = int(lines[marks[0]].split()[1])
        assert lines[marks[0] + 1 :] == original[resumes_at - 1 :]


def test_backend_imports_without_loading_cupy():
    code = "import sys, kvtierd.kernels.cuda_backend; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_kernels_unavailable_without_a_gpu():
    if not torch.cuda.is_available():
        assert not cuda_backend.cuda_kernels_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the bench runs (tests/test_kernels_gpu.py)")
def test_bench_kernels_without_a_gpu_says_why_in_one_line():
    done = subprocess.run([sys.executable, "-m", "kvtierd.cli.main", "bench", "kernels"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error: kernel benchmarks need a CUDA GPU")


# --- on a GPU host: the same sources through CuPy's loader, for this device's own architecture ---------------

@pytest.fixture
def gpu():
    if not cuda_backend.cuda_kernels_available():
        pytest.skip("needs a CUDA GPU and cupy (the 'cuda' extra)")


@pytest.mark.gpu
@pytest.mark.parametrize("filename", FILES)
def test_every_kernel_loads_through_cupy_on_this_gpu(gpu, filename):
    """RawModule compiles the file for the GPU present (its arch, not only sm_80/sm_90) and the driver
    loads each kernel from the binary: what the daemon does on its first step."""
    import cupy

    with cupy.cuda.Device(0):
        for name in cuda_backend.KERNEL_FILES[filename]:
            kernel = cuda_backend._kernel(name, 0)
            assert kernel.num_regs > 0 and kernel.max_threads_per_block >= 128, name


@pytest.mark.gpu
def test_a_tiny_launch_writes_kv_where_its_slots_say(gpu):
    cache = torch.zeros(2, 4, 1, 32, dtype=torch.float16, device="cuda")  # 2 pages of 4 tokens, 1 head of 32
    k_cache, v_cache = cache.clone(), cache.clone()
    k = torch.arange(1, 65, dtype=torch.float16, device="cuda").reshape(2, 1, 32)
    cuda_backend.write_kv(k_cache, v_cache, k, -k, torch.tensor([6, 1], device="cuda"))
    torch.cuda.synchronize()
    flat_k, flat_v = k_cache.reshape(8, 1, 32), v_cache.reshape(8, 1, 32)
    assert torch.equal(flat_k[6], k[0]) and torch.equal(flat_k[1], k[1]) and torch.equal(flat_v[6], -k[0])
    assert int(torch.count_nonzero(flat_k[[0, 2, 3, 4, 5, 7]])) == 0  # nothing else written
