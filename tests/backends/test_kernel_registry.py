"""The kernel registry (``backends/kernels.py``): its rows, the order devices prefer, the refusals
it answers with, the formats kernels claim, and that it loads nothing until asked."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from pagedllm.backends import kernels, registry
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.gpu.backend import CudaBackend
from pagedllm.backends.kernels import Kernel
from pagedllm.backends.xpu.backend import XpuBackend

BACKENDS = (CpuBackend, CudaBackend, XpuBackend)
HERE = "tests.backends.test_kernel_registry"


def test_importing_the_registry_imports_no_torch() -> None:
    """The CLI lists devices and kernels without torch: rows are strings until one is built."""
    code = (
        "import sys\n"
        "from pagedllm.backends import kernels, registry\n"
        "assert registry.device_names()[0] == 'auto'\n"
        "assert kernels.impls_on('attention', 'cpu')[0] == 'cpp'\n"
        "assert kernels.entry('linear', 'cpp').formats\n"
        "assert 'torch' not in sys.modules, 'torch imported by the registry'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_row_is_well_formed() -> None:
    devices = set(registry.device_names()) - {"auto"}
    seen: set[tuple[str, str]] = set()
    for row in kernels.KERNELS:
        assert row.op in kernels.OPS and row.impl in kernels.IMPLS, row
        assert row.devices and set(row.devices) <= devices, row
        module, _, name = row.target.partition(":")
        assert module.startswith("pagedllm.") and name, row.target
        assert (row.op, row.impl) not in seen, f"two rows for {row.op}/{row.impl}"
        seen.add((row.op, row.impl))
        assert {d for d, _ in row.requires} <= set(row.devices), row
    assert set(kernels.OPS) == kernels.BUILT_OPS | set(kernels.INSTALLED_OPS)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_each_device_prefers_only_kernels_registered_for_it(cls: type) -> None:
    for op, order in cls.kernel_order.items():
        assert order, f"{cls.name}: an empty order for {op} (leave the op out instead)"
        assert set(order) <= set(kernels.impls_on(op, cls.name)), (cls.name, op, order)
    assert cls.kernel_order["attention"]


def test_triton_kernels_are_offered_to_every_device_that_runs_triton() -> None:
    for row in kernels.KERNELS:
        if row.impl == "triton":
            assert set(row.devices) == {"cuda", "xpu", "cpu"}, row


def test_the_cpu_group_kernels_claim_the_group_wise_formats() -> None:
    """The formats rows claim are the quantization method's table, no other name list."""
    from pagedllm.layers.quantization.groupwise import FORMATS

    for op in ("linear", "moe"):
        assert kernels.entry(op, "cpp").formats == set(FORMATS), op
    assert CpuBackend().kernel("linear").formats == set(FORMATS)
    # A device without a linear kernel multiplies no format as stored: GGUF layers dequantise.
    assert CudaBackend().kernel("linear").formats == frozenset()
    assert XpuBackend().kernel("linear").formats == frozenset()


def test_a_format_not_claimed_is_refused() -> None:
    chosen = kernels.select("linear", "cpu", ("cpp",), fmt="q4_k")
    assert chosen.kernel is None and chosen.value is None
    assert [(r.impl, r.reason, r.detail) for r in chosen.refused] == [
        ("cpp", "format not claimed", "q4_k")
    ]
    assert kernels.select("linear", "cpu", ("cpp",), fmt="int4").kernel == kernels.entry(
        "linear", "cpp"
    )
    on_gpu = kernels.select("linear", "cuda", (), fmt="int4")
    assert on_gpu.kernel is None
    assert [(r.impl, r.reason) for r in on_gpu.refused] == [
        ("cpp", "not registered for the device")
    ]


# -- selection over rows made for the test ------------------------------------------------------
def _cannot_run() -> None:
    return None


def _raises() -> None:
    raise OSError("no compiler")


def _works() -> str:
    return "sampled"


FAKE_ROWS = (
    Kernel("sample", "cpp", f"{HERE}:_cannot_run", ("cpu",)),
    Kernel("sample", "triton", "pagedllm.no_such_module:x", ("cpu", "cuda")),
    Kernel("sample", "ipex", f"{HERE}:_raises", ("cpu",)),
    Kernel("sample", "torch", f"{HERE}:_works", ("cpu",)),
    Kernel("sample", "reference", f"{HERE}:_works", ("cuda",)),
)


@pytest.fixture
def fake_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "KERNELS", FAKE_ROWS)


def test_selection_walks_the_order_and_says_why_each_other_was_refused(fake_rows: None) -> None:
    chosen = kernels.select("sample", "cpu", ("cpp", "triton", "ipex", "torch", "reference"))
    assert chosen.kernel is not None and chosen.kernel.impl == "torch"
    assert chosen.value == "sampled"
    reasons = {r.impl: r.reason for r in chosen.refused}
    assert reasons == {
        "cpp": "unavailable",
        "triton": "import failed",
        "ipex": "unavailable",
        "reference": "not registered for the device",
    }
    assert [str(r) for r in chosen.failures()] == [
        "cpp: cannot run on this machine",
        "triton: No module named 'pagedllm.no_such_module'",
        "ipex: no compiler",
    ]
    assert "sample on cpu: torch (cpp: unavailable" in chosen.explain()


def test_rows_after_the_choice_and_outside_the_order_are_not_loaded(fake_rows: None) -> None:
    """A device's first choice is the only row built: the others are refused from their rows."""
    chosen = kernels.select("sample", "cpu", ("torch", "triton"))
    assert chosen.kernel is not None and chosen.kernel.impl == "torch"
    assert [(r.impl, r.reason) for r in chosen.refused] == [
        ("triton", "an earlier choice won"),
        ("cpp", "not in the device's order"),
        ("ipex", "not in the device's order"),
        ("reference", "not registered for the device"),
    ]
    assert "pagedllm.no_such_module" not in sys.modules


def test_no_kernel_is_an_answer_and_require_names_every_refusal(fake_rows: None) -> None:
    nothing = kernels.select("sample", "cpu", ("cpp", "ipex"))
    assert nothing.kernel is None and nothing.value is None and nothing.formats == frozenset()
    with pytest.raises(ImportError, match=r"cpp: unavailable .*ipex: unavailable \(no compiler"):
        nothing.require()


def test_unknown_ops_and_implementations_are_errors() -> None:
    with pytest.raises(ValueError, match=r"^kernel op: unknown op 'matmul'; choose one of"):
        kernels.entries("matmul")
    with pytest.raises(ValueError, match=r"no 'cpp' implementation of 'lora'; registered: \["):
        kernels.entry("lora", "cpp")
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        kernels.select("attention", "cpu", ("cuda",))  # type: ignore[arg-type]


def test_a_requirement_gates_a_row_on_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on XPU needs triton's Intel backend; the same row on CUDA does not ask."""
    from pagedllm.backends.xpu import backend as xpu_backend

    monkeypatch.setattr(xpu_backend, "triton_supports_xpu", lambda: False)
    chosen = kernels.select("lora", "xpu", ("triton", "torch"))
    assert chosen.kernel is not None and chosen.kernel.impl == "torch"
    assert [(r.impl, r.reason, r.detail) for r in chosen.failures()] == [
        ("triton", "requirement unmet", "triton_supports_xpu() is false")
    ]


def test_cpu_choices() -> None:
    """What the CPU device gets for the ops that need no extension build to answer."""
    from pagedllm.lora.ops import TorchLoRAOps

    cpu = CpuBackend()
    assert isinstance(cpu.kernel("lora").require(), TorchLoRAOps)
    for op in kernels.INSTALLED_OPS:
        chosen = cpu.kernel(op)
        want = "torch" if op == "encoder_attention" else "cpp"
        assert chosen.kernel is not None and chosen.kernel.impl == want, op
        assert callable(chosen.value)
    assert XpuBackend().kernel("sample").kernel is None  # XPU samples with draw_reference


def _linear(model: Any, *, int8_activations: bool) -> dict[str, str]:
    model.append(("linear", int8_activations))
    return {"QKVParallelLinear": "cpp-x", "RowParallelLinear": "cpp-y"}


def _moe(model: Any, *, int8_activations: bool) -> str:
    return ""


def _norm(model: Any, *, int8_activations: bool) -> str:
    model.append(("norm", int8_activations))
    return "rms_norm x3"


def test_install_runs_each_chosen_installer_and_describes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = (
        Kernel("linear", "cpp", f"{HERE}:_linear", ("cpu",)),
        Kernel("moe", "cpp", f"{HERE}:_moe", ("cpu",)),
        Kernel("norm", "cpp", f"{HERE}:_norm", ("cpu",)),
        Kernel("rotary", "cpp", f"{HERE}:_norm", ("cuda",)),
    )
    monkeypatch.setattr(kernels, "KERNELS", rows)
    calls: list[tuple[str, bool]] = []
    order = {"linear": ("cpp",), "moe": ("cpp",), "norm": ("cpp",), "rotary": ("cpp",)}
    paths = kernels.install(calls, "cpu", order, int8_activations=True)  # type: ignore[arg-type]
    assert paths == ("QKVParallelLinear=cpp-x, RowParallelLinear=cpp-y", "rms_norm x3")
    assert calls == [("linear", True), ("norm", True)]
    assert kernels.install([], "cpu", {}, int8_activations=False) == ("", "none")
