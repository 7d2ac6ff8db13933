"""``--cpu-bind``: the plan over the CPUs a process may use, and threads bound one by one.

Binding changes the process it runs in, so every test that binds runs in a child process and
reads the masks back from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.engine.cpu_binding import CpuBinding, available_cpus

two_cpus = pytest.mark.skipif(
    len(available_cpus()) < 2, reason="binding needs two CPUs this process may use"
)


def test_plan_puts_the_core_main_thread_alone_on_the_first_cpu() -> None:
    assert CpuBinding.plan("auto", {1, 0}) == CpuBinding(core_main=(0,), rest=(1,))
    assert CpuBinding.plan("auto", [7, 3, 5]) == CpuBinding(core_main=(3,), rest=(5, 7))
    wide = CpuBinding.plan("auto", range(16))
    assert wide is not None and wide.rest == tuple(range(1, 16))
    assert "main thread on CPU 0" in wide.describe() and "CPU 1-15" in wide.describe()


def test_plan_binds_nothing_when_off_or_on_one_cpu() -> None:
    assert CpuBinding.plan("off", {0, 1}) is None
    assert CpuBinding.plan("auto", {4}) is None
    assert CpuBinding.plan("auto", set()) is None


def test_plan_refuses_an_unknown_mode_by_name() -> None:
    with pytest.raises(ValueError, match="cpu_bind: must be one of auto, off, got 'fast'"):
        CpuBinding.plan("fast", {0, 1})


_CHILD = textwrap.dedent(
    """
    import json, os, threading, time
    from pagedllm.engine.cpu_binding import CoreThreadBinder, CpuBinding, thread_ids

    def masks():
        return {tid: sorted(os.sched_getaffinity(tid)) for tid in thread_ids()}

    stop = threading.Event()
    early = threading.Thread(target=stop.wait)
    early.start()
    binder = CoreThreadBinder(CpuBinding(core_main=(MAIN,), rest=(REST,)), interval=1.0)
    binder.bind()
    after_bind = masks()
    late = threading.Thread(target=stop.wait)  # started by the main thread: inherits its mask
    late.start()
    inherited = sorted(os.sched_getaffinity(late.native_id))
    binder.maybe_rebind(time.monotonic() + 0.5)  # the first check: a new thread is rebound
    rebound = sorted(os.sched_getaffinity(late.native_id))
    stop.set()
    print(json.dumps({"main": os.getpid(), "early": early.native_id, "after_bind": after_bind,
                      "inherited": inherited, "rebound": rebound}))
    """
)


@two_cpus
def test_core_threads_are_bound_and_a_late_thread_is_rebound() -> None:
    main_cpu, rest_cpu = sorted(available_cpus())[:2]
    code = _CHILD.replace("MAIN", str(main_cpu)).replace("REST", str(rest_cpu))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    masks = {int(k): v for k, v in got["after_bind"].items()}
    assert masks[got["main"]] == [main_cpu]
    assert masks[got["early"]] == [rest_cpu]
    assert all(m == [rest_cpu] for tid, m in masks.items() if tid != got["main"])
    assert got["inherited"] == [main_cpu]  # what the kernel does; the binder then fixes it
    assert got["rebound"] == [rest_cpu]


def test_serve_binds_only_a_single_rank_engine_core() -> None:
    from pagedllm.entrypoints.cli import build_parser, serve_cpu_binding

    parse = build_parser().parse_args
    allowed = available_cpus()
    default = serve_cpu_binding(parse(["serve", "m"]))
    assert default == CpuBinding.plan("auto", allowed)
    assert serve_cpu_binding(parse(["serve", "m", "--cpu-bind", "off"])) is None
    assert serve_cpu_binding(parse(["serve", "m", "--engine-in-process"])) is None
    assert serve_cpu_binding(parse(["serve", "m", "--tensor-parallel-size", "2"])) is None
    assert serve_cpu_binding(parse(["serve", "m", "--pipeline-parallel-size", "2"])) is None
    with pytest.raises(SystemExit):
        parse(["serve", "m", "--cpu-bind", "fast"])
    assert os.sched_getaffinity(0) == allowed  # planning binds nothing
