"""Build (once per machine) and load the C++ paged-attention extension of the CPU backend.

The extension is compiled with ``torch.utils.cpp_extension.load`` into
``~/.cache/pagedllm/cpu_ext/<key>``, where ``<key>`` hashes everything that changes the binary:
the sources, the compiler flags, the torch and Python versions and the machine architecture. So a
second process (another test, a tensor-parallel worker) finds the library already built and only
imports it, and an edit to a source file or a torch upgrade lands in a fresh directory instead of
loading a stale binary.

Flags are ``-O3 -mavx2 -mfma -fopenmp`` when the CPU has AVX2 (asked of torch's own dispatcher),
otherwise ``-O3 -fopenmp`` and the kernels' scalar path. ``-march=native`` is avoided on purpose:
it could emit AVX-512 on one machine and the cache key must describe what was built.

Failures raise ``RuntimeError`` (no compiler, no ninja, compile error) or ``ImportError``, which is
what :meth:`pagedllm.backends.cpu.backend.CpuBackend.attention` catches to fall back to PyTorch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "pagedllm_cpu_ops"
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("attention.cpp", "cache_ops.cpp", "bindings.cpp")
_HEADERS = ("attention.h", "vec.h")
_BUILT_MARKER = "built.ok"


def default_build_root() -> Path:
    """Where built extensions live, one sub-directory per build key."""
    return Path.home() / ".cache" / "pagedllm" / "cpu_ext"


def cpu_has_avx2() -> bool:
    """True when torch's dispatcher found AVX2 (or better) on this CPU."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except (AttributeError, RuntimeError):
        return False


def compile_flags(avx2: bool | None = None) -> list[str]:
    """Compiler flags for this machine; AVX2/FMA only where the CPU runs them."""
    use_avx2 = cpu_has_avx2() if avx2 is None else avx2
    return ["-O3", *(["-mavx2", "-mfma"] if use_avx2 else []), "-fopenmp"]


def build_key(flags: list[str]) -> str:
    """Hash of everything that changes the built library."""
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update(name.encode())
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def _module_name(flags: list[str]) -> str:
    # Distinct names: both builds may be imported into one process (tests), and CPython keys
    # extension modules by name.
    return EXTENSION_NAME if "-mavx2" in flags else f"{EXTENSION_NAME}_scalar"


def _import_built(build_dir: Path, name: str) -> ModuleType:
    path = build_dir / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU attention extension from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_toolchain() -> None:
    if shutil.which("c++") is None:
        raise RuntimeError(
            "cannot build the C++ CPU attention kernels: no C++ compiler (`c++`) on PATH; "
            "install g++ (e.g. apt-get install g++) or use attention_backend='torch'"
        )
    if shutil.which("ninja") is None:
        raise RuntimeError(
            "cannot build the C++ CPU attention kernels: `ninja` is not on PATH; "
            "pip install ninja (and activate the virtualenv) or use attention_backend='torch'"
        )


def load_ops(
    build_root: Path | None = None, *, avx2: bool | None = None, verbose: bool = False
) -> ModuleType:
    """The compiled extension module, built on first use and cached on disk.

    ``avx2=None`` follows the CPU; ``False`` builds the portable scalar path (tests use it to
    cover the code a machine without AVX2 runs).
    """
    flags = tuple(compile_flags(avx2))
    build_dir = (build_root or default_build_root()) / build_key(list(flags))
    return _load(build_dir, flags, verbose)


@functools.cache
def _load(build_dir: Path, flags: tuple[str, ...], verbose: bool) -> ModuleType:
    """Memoised per process (a loaded module is immutable); across processes the marker written
    after a successful build lets later loads import the library without running ninja."""
    name = _module_name(list(flags))
    if (build_dir / _BUILT_MARKER).exists():
        try:
            return _import_built(build_dir, name)
        except (ImportError, OSError) as exc:
            logger.warning("rebuilding the CPU attention extension in %s: %s", build_dir, exc)
    _check_toolchain()
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    logger.info("building the C++ CPU attention kernels in %s (first use only)", build_dir)
    module = load(
        name=name,
        sources=[str(_CSRC / s) for s in _SOURCES],
        extra_cflags=list(flags),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    (build_dir / _BUILT_MARKER).write_text(" ".join(flags) + "\n")
    return module
