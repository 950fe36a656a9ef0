"""Builds kvflow._C with torch.utils.cpp_extension.

The CPU sources are always built. The CUDA sources are added when torch is a CUDA build and a
CUDA toolkit is found (KVFLOW_CUDA=0 forces a CPU-only build, KVFLOW_CUDA=1 makes a missing
toolkit an error). TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0a". KVFLOW_SKIP_EXTENSION=1 installs
the Python package alone (scripts/install.sh then runs `setup.py build_ext --inplace`).
"""

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def read_sources():
    """csrc/sources.txt, the one list of sources that CMakeLists.txt reads too."""
    sources = {"core": [], "torch": [], "cuda": []}
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            kind, path = line.split()
            sources[kind].append(path)
    return sources


def find_cuda_home():
    """The real toolkit directory. The nvcc first on PATH may be a wrapper script elsewhere,
    so its parent directory is only one candidate among the usual install locations."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates += ["/usr/local/cuda"] + sorted(map(str, Path("/usr/local").glob("cuda-*")), reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file() and (
            Path(candidate) / "include" / "cuda_runtime.h"
        ).is_file():
            return candidate
    return None


def want_cuda(torch):
    flag = os.environ.get("KVFLOW_CUDA", "auto").lower()
    if flag in ("0", "false", "off", "no"):
        return None
    cuda_home = find_cuda_home()
    possible = torch.version.cuda is not None and cuda_home is not None
    if flag in ("1", "true", "on", "yes") and not possible:
        raise RuntimeError(
            f"KVFLOW_CUDA=1 but torch is {'a CPU build' if torch.version.cuda is None else 'a CUDA build'} "
            f"and the CUDA toolkit was {'not found' if cuda_home is None else 'found at ' + cuda_home}"
        )
    return cuda_home if possible else None


def extensions():
    if os.environ.get("KVFLOW_SKIP_EXTENSION") == "1":
        return [], {}  # scripts/install.sh installs the package this way, then builds _C incrementally
    import torch

    cuda_home = want_cuda(torch)
    if cuda_home:
        # Read by torch.utils.cpp_extension when it is imported, so set it first.
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    sources = read_sources()
    # -fopenmp: at::parallel_for is OpenMP pragmas inlined from ATen's headers, so without it the
    # CPU ops silently run on one thread. libgomp resolves to the copy torch already loaded.
    cxx_flags = ["-O3", "-fopenmp", "-fvisibility=hidden", "-Wno-maybe-uninitialized"]
    link_flags = ["-fopenmp"]
    include_dirs = [str(ROOT / "csrc" / "include"), str(ROOT / "csrc")]
    if cuda_home:
        ext = CUDAExtension(
            "kvflow._C",
            sources=sources["core"] + sources["torch"] + sources["cuda"],
            include_dirs=include_dirs,
            define_macros=[("KVFLOW_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=link_flags,
        )
    else:
        ext = CppExtension(
            "kvflow._C",
            sources=sources["core"] + sources["torch"],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()

setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
