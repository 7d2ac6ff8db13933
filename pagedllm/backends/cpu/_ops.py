"""Build (once per machine and ISA) and load the C++ extension of the CPU backend.

The extension (every kernel: paged attention, cache ops, layer kernels, weight GEMMs, the decode
stack; one since the decode stack calls them all directly) goes through
:func:`load_extension`: it is compiled with ``torch.utils.cpp_extension.load`` into
``~/.cache/pagedllm/cpu_ext/<key>``, where ``<key>`` hashes everything that changes the binary:
the sources, the compiler flags, the torch and Python versions and the machine architecture. So a
second process (another test, a tensor-parallel worker) finds the library already built and only
imports it, and an edit to a source file or a torch upgrade lands in a fresh directory instead of
loading a stale binary.

**Run-time ISA dispatch.** The same sources are built once per *ISA level* with that level's
flags, and the level is chosen at load from what ``/proc/cpuinfo`` reports (best first), or
forced with ``PAGEDLLM_CPU_ISA`` (read in :mod:`pagedllm.config`) so that tests and benchmarks can
run every path the machine supports. ``-march=native`` is avoided on purpose: the cache key must
describe what was built, and a build must never emit instructions the level does not promise.
Sources pick their vector code with the compiler's macros (``__AVX512F__``, ``__AVX512BF16__``,
``__AVX2__``...), and each extension reports the level it was built for.

Failures raise ``RuntimeError`` (no compiler, no ninja, compile error, a level this CPU cannot run)
or ``ImportError``, which callers turn into a fallback to PyTorch ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.backends.cpu.build_progress import BuildProgress
from pagedllm.config import env_cpu_isa

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_BUILT_MARKER = "built.ok"
# Our cross-process build lock, and the file torch.utils.cpp_extension holds while it builds.
_FLOCK = "build.flock"
_TORCH_BATON = "lock"


@dataclass(frozen=True)
class IsaLevel:
    """One build flavour: the compiler flags and the ``/proc/cpuinfo`` flags it needs."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]


# Best first. avx512bf16 adds the bf16 dot products and VNNI to plain AVX-512 (Cooper Lake,
# Sapphire Rapids and later); avx2 is the Haswell/Zen baseline with FMA and F16C conversions.
_AVX512 = "avx512f avx512bw avx512vl avx512dq"


def _level(name: str, cflags: str, cpu_flags: str) -> IsaLevel:
    return IsaLevel(name, tuple(f"-m{f}" for f in cflags.split()), frozenset(cpu_flags.split()))


ISA_LEVELS: tuple[IsaLevel, ...] = (
    _level(
        "avx512bf16",
        f"{_AVX512} avx512bf16 avx512vnni avx2 fma f16c",
        f"{_AVX512} avx512_bf16 avx512_vnni avx2 fma f16c",
    ),
    _level("avx512", f"{_AVX512} avx2 fma f16c", f"{_AVX512} avx2 fma f16c"),
    _level("avx2", "avx2 fma f16c", "avx2 fma f16c"),
    _level("scalar", "", ""),
)
_LEVELS = {level.name: level for level in ISA_LEVELS}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags this processor reports (empty off x86 or without procfs)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    """The processor's model name, for logs and benchmark JSON."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_isas() -> list[str]:
    """The ISA levels this processor runs, best first (``scalar`` is always last)."""
    flags = cpu_flags()
    return [level.name for level in ISA_LEVELS if level.cpu_flags <= flags]


def resolve_isa(isa: str | None = None) -> str:
    """``isa`` if given, else ``PAGEDLLM_CPU_ISA`` if set, else the best level this CPU runs."""
    requested = isa or env_cpu_isa()
    supported = supported_isas()
    if requested is None or requested == "auto":
        return supported[0]
    if requested not in _LEVELS:
        raise ValueError(
            f"PAGEDLLM_CPU_ISA: unknown ISA level {requested!r}; choose one of {['auto', *_LEVELS]}"
        )
    if requested not in supported:
        raise RuntimeError(
            f"PAGEDLLM_CPU_ISA: this processor cannot run the {requested!r} path; "
            f"it supports {supported}"
        )
    return requested


def compile_flags(isa: str) -> list[str]:
    """Compiler flags of one ISA level (never ``-march=native``)."""
    return ["-O3", *_LEVELS[isa].cflags, "-fopenmp"]


def build_key(sources: Sequence[str], headers: Sequence[str], flags: Sequence[str]) -> str:
    """Hash of everything that changes the built library."""
    h = hashlib.sha256()
    for name in (*sources, *headers):
        h.update(name.encode())
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def default_build_root() -> Path:
    """Where built extensions live, one sub-directory per build key."""
    return Path.home() / ".cache" / "pagedllm" / "cpu_ext"


def _import_built(build_dir: Path, name: str) -> ModuleType:
    path = build_dir / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU extension from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_toolchain() -> None:
    if shutil.which("c++") is None:
        raise RuntimeError(
            "cannot build the C++ CPU kernels: no C++ compiler (`c++`) on PATH; "
            "install g++ (e.g. apt-get install g++) or use attention_backend='torch'"
        )
    if shutil.which("ninja") is None:
        raise RuntimeError(
            "cannot build the C++ CPU kernels: `ninja` is not on PATH; "
            "pip install ninja (and activate the virtualenv) or use attention_backend='torch'"
        )


def load_extension(
    name: str,
    sources: Sequence[str],
    headers: Sequence[str] = (),
    *,
    isa: str | None = None,
    build_root: Path | None = None,
    verbose: bool = False,
) -> ModuleType:
    """Extension ``name`` built from ``csrc/<sources>`` for one ISA level, cached on disk.

    ``isa=None`` follows ``PAGEDLLM_CPU_ISA`` or else the CPU. The module is named
    ``<name>_<isa>``: several levels may be imported into one process (tests), and CPython keys
    extension modules by name.
    """
    level = resolve_isa(isa)
    flags = tuple(compile_flags(level))
    build_dir = extension_dir(sources, headers, level, build_root)
    return _load(f"{name}_{level}", build_dir, tuple(sources), flags, verbose)


def extension_dir(
    sources: Sequence[str], headers: Sequence[str], isa: str, build_root: Path | None = None
) -> Path:
    """Where the extension of ``sources`` for ISA level ``isa`` is (or will be) built."""
    key = build_key(sources, headers, compile_flags(isa))
    return (build_root or default_build_root()) / key


def is_built(build_dir: Path) -> bool:
    """Whether a build finished in ``build_dir`` (a later load only imports it)."""
    return (build_dir / _BUILT_MARKER).exists()


@functools.cache
def _load(
    module_name: str,
    build_dir: Path,
    sources: tuple[str, ...],
    flags: tuple[str, ...],
    verbose: bool,
) -> ModuleType:
    """Memoised per process (a loaded module is immutable); across processes the marker written
    after a successful build lets later loads import the library without running ninja."""
    if is_built(build_dir):
        try:
            return _import_built(build_dir, module_name)
        except (ImportError, OSError) as exc:
            logger.warning("rebuilding the CPU extension in %s: %s", build_dir, exc)
    _check_toolchain()
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if (build_dir / _BUILT_MARKER).exists():  # another process built it while we waited
            try:
                return _import_built(build_dir, module_name)
            except (ImportError, OSError) as exc:
                logger.warning("rebuilding the CPU extension in %s: %s", build_dir, exc)
        from torch.utils.cpp_extension import load

        logger.warning(
            "building CPU kernels for this processor (first run only, ~%d min): %s in %s",
            build_minutes(len(sources)),
            module_name,
            build_dir,
        )
        started = time.monotonic()
        with BuildProgress(build_dir, sources, module_name, logger.warning):
            module = load(
                name=module_name,
                sources=[str(_CSRC / s) for s in sources],
                extra_cflags=list(flags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=verbose,
            )
        (build_dir / _BUILT_MARKER).write_text(" ".join(flags) + "\n")
        logger.warning("built %s in %.0f s", module_name, time.monotonic() - started)
    return module


def build_minutes(num_sources: int, cpus: int | None = None) -> int:
    """A rough build time to announce, so the first run's silent minutes are expected: about
    half a minute of compiler time per source file, run in parallel by ninja, plus linking."""
    cpus = max(1, min(cpus or os.cpu_count() or 1, num_sources))
    return max(1, round((30 * num_sources / cpus + 20) / 60))


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder per directory across processes, and no lock outlives its process.

    torch's own guard is a file that exists while a build runs (``lock``): a build killed
    mid-way (Ctrl-C on the first run, an OOM kill, a machine restart) leaves it behind and every
    later process waits on it forever. An ``flock`` is dropped by the kernel when its holder dies,
    so while we hold ours, any ``lock`` file is such a leftover and is removed.
    """
    with open(build_dir / _FLOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # say why nothing happens for minutes
            logger.warning("waiting for another process building the CPU kernels in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / _TORCH_BATON
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_objects(
    isa: str,
    out_dir: Path,
    sources: Sequence[str],
    *,
    module_name: str = "pagedllm_compile_check",
) -> list[Path]:
    """Compile ``csrc/<sources>`` (an absolute path as it is) to object files for any ISA level,
    never linking or loading.

    The check that keeps code for processors this machine lacks (AVX-512 on an AVX2 host) from
    rotting: the compiler accepts every level's flags whatever the host runs. Same ISA flags,
    defines and include paths as :func:`load_extension`'s build, but ``-O0``: the objects are
    never run, and what the check is for is still diagnosed there (syntax and types under the
    level's ``#if``, an intrinsic the level lacks: GCC inlines ``always_inline`` intrinsics at
    -O0 too and reports the target mismatch; immediates must be constants, as -O0's intrinsic
    macros demand), at about half the compiler time of -O3 on the heavy sources. Raises
    ``RuntimeError`` with the compiler's output on failure.
    """
    from torch.utils.cpp_extension import include_paths

    if isa not in _LEVELS:
        raise ValueError(f"isa: unknown ISA level {isa!r}; choose one of {list(_LEVELS)}")
    _check_toolchain()
    out_dir.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    base = [
        "c++",
        "-c",
        "-std=c++20",
        "-fPIC",
        *(flag if not flag.startswith("-O") else "-O0" for flag in compile_flags(isa)),
        f"-DTORCH_EXTENSION_NAME={module_name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])),
    ]
    objects = [out_dir / f"{Path(src).stem}.{isa}.o" for src in sources]

    def compile_one(src: str, obj: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, str(_CSRC / src), "-o", str(obj)], capture_output=True, text=True
        )

    # One compiler per core, as ninja runs a real build: the check compiled one file at a time
    # and was the test suite's longest item (two levels x nine files, then at -O3).
    workers = max(1, min(len(sources), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        procs = list(pool.map(compile_one, sources, objects))
    for src, proc in zip(sources, procs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {src} for {isa} failed:\n{proc.stderr[-4000:]}")
    return objects


CPU_EXTENSION = "pagedllm_cpu_kernels"
# One extension for every kernel: the decode stack calls the attention, row-wise and sampling
# kernels directly, so with two extensions their sources were compiled into both (four of five
# sources of the first compiled twice at every build, ISA level and CI leg).
_SOURCES = (
    "gemm.cpp",
    "gemm_i8.cpp",
    "gemm_amx.cpp",
    "gemm_q4.cpp",
    "gemm_q4_pack.cpp",
    "gguf_decode.cpp",
    "decode_stack.cpp",
    "pointwise.cpp",
    "cache_ops.cpp",
    "attention.cpp",
    "sampling.cpp",
    "bindings.cpp",
)
_HEADERS = (
    "tensor_api.h",
    "convert.h",
    "vec.h",
    "dtype_dispatch.h",
    "task_queue.h",
    "gemm_vec.h",
    "gemm_i8.h",
    "gemm_dp.h",
    "gemm_amx.h",
    "gemm_q4.h",
    "gemm_q4_layout.h",
    "gemm_q4_float.h",
    "gemm_q4_avx2.h",
    "gemm_q4_avx2_tiles.h",
    "gemm_q4_dot.h",
    "gemm_q4_dot_tiles.h",
    "decode_stack.h",
    "attention.h",
    "pointwise.h",
    "sampling.h",
    "bindings.h",
)


def load_kernels(build_root: Path | None = None, *, isa: str | None = None) -> ModuleType:
    """The CPU kernel extension for one ISA level (see :func:`load_extension`): paged
    attention, cache ops, row-wise layer kernels, sampling, the 16/8/4-bit weight GEMMs and
    the decode stack."""
    return load_extension(CPU_EXTENSION, _SOURCES, _HEADERS, isa=isa, build_root=build_root)


# Every extension of this backend (name, sources, headers): what `python -m
# pagedllm.backends.cpu.build` (run by `make setup`) builds ahead of the first run. A new
# extension goes here too (a test checks every *_EXTENSION name is listed).
EXTENSIONS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    (CPU_EXTENSION, _SOURCES, _HEADERS),
)
