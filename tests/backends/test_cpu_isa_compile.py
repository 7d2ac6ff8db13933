"""The AVX-512 builds of the CPU kernels compile, on any x86 host.

This machine may lack AVX-512, so those paths cannot run here; compiling them (object files only,
never linked or loaded: a load could execute an instruction the CPU lacks) keeps them from
rotting. The kernels' sources carry all the ISA-specific code, so the attention, cache-op,
layer-kernel and weight-GEMM translation units are what is compiled; the bindings have none.
They compile at -O0 (about half the compiler time of -O3), where an intrinsic the level lacks
is still an error: a planted one is checked to fail.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx512bf16"])
def test_avx512_variants_compile(isa: str, tmp_path: Path) -> None:
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain (c++ and ninja)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 ISA levels compile only with an x86 compiler")
    from pagedllm.backends.cpu._ops import compile_objects

    sources = (
        "attention.cpp",
        "cache_ops.cpp",
        "pointwise.cpp",
        "sampling.cpp",
        "gemm.cpp",
        "gemm_i8.cpp",
        "gemm_amx.cpp",
        "gemm_q4.cpp",
        "gemm_q4_pack.cpp",
    )
    objects = compile_objects(isa, tmp_path, sources)
    assert [o.name for o in objects] == [f"{Path(s).stem}.{isa}.o" for s in sources]
    assert all(o.stat().st_size > 0 for o in objects)


def test_compile_objects_rejects_unknown_level(tmp_path: Path) -> None:
    from pagedllm.backends.cpu._ops import compile_objects

    with pytest.raises(ValueError, match="^isa: "):
        compile_objects("avx9000", tmp_path, ("attention.cpp",))


@pytest.mark.parametrize(("isa", "compiles"), [("avx512", False), ("avx512bf16", True)])
def test_check_reports_an_intrinsic_the_level_lacks(
    isa: str, compiles: bool, tmp_path: Path
) -> None:
    """The check compiles at -O0 (never run, half the compiler time): a bf16 dot product in a
    block that only asks for AVX-512F must still fail there, as it would in an -O3 build."""
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain (c++ and ninja)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 ISA levels compile only with an x86 compiler")
    from pagedllm.backends.cpu._ops import compile_objects

    source = tmp_path / "planted.cpp"
    source.write_text(
        "#include <immintrin.h>\n"
        "#if defined(__AVX512F__)\n"
        "__m512 dot(__m512 a, __m512bh b, __m512bh c) { return _mm512_dpbf16_ps(a, b, c); }\n"
        "#endif\n"
    )
    if compiles:
        assert compile_objects(isa, tmp_path / "out", (str(source),))
    else:
        with pytest.raises(RuntimeError, match="target specific option mismatch"):
            compile_objects(isa, tmp_path / "out", (str(source),))
