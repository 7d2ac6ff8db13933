"""Multi-LoRA in the scheduler and block manager (no model): a step never holds more distinct
adapters than ``max_loras`` (later requests of other adapters are passed over, not blocked), and
the prefix cache keys a sequence's blocks under its adapter's root."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceGroup
from tests.core.helpers import fake_step, make_group, make_scheduler


@dataclass(frozen=True)
class Adapter:  # what the core reads of a LoRARequest
    lora_int_id: int


def lora_group(name: str, lora: int | None, **kw: object) -> SequenceGroup:
    group = make_group(name, 5, **kw)  # type: ignore[arg-type]
    group.lora_request = None if lora is None else Adapter(lora)
    if lora is not None:
        group.seqs[0].cache_root = hash(("lora", lora))
    return group


def with_loras(max_loras: int, **kw: object) -> Scheduler:
    s = make_scheduler(num_blocks=64, **kw)
    s.max_loras = max_loras
    return s


def ids(out) -> list[str]:
    return [x.request_id for x in out.seqs]


def test_third_adapter_waits_and_later_requests_pass_it() -> None:
    s = with_loras(2)
    for name, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("base", None)]:
        s.add(lora_group(name, lora, max_tokens=2))
    out = fake_step(s)
    assert ids(out) == ["a", "b", "d", "base"]  # c's adapter would be a third
    assert [g.request_id for g in s.waiting] == ["c"]
    fake_step(s)  # a, b, d, base decode their last token and finish
    assert ids(fake_step(s)) == ["c"]


def test_running_adapters_count_against_the_limit() -> None:
    s = with_loras(1)
    s.add(lora_group("a", 1, max_tokens=3))
    fake_step(s)
    s.add(lora_group("b", 2))
    s.add(lora_group("a2", 1))
    out = fake_step(s)
    assert ids(out) == ["a2"]  # same adapter as the running one; b must wait
    while "b" not in ids(out):
        out = fake_step(s)
    assert {g.lora_id for g in s.running} == {2}


def test_no_limit_without_lora() -> None:
    s = make_scheduler(num_blocks=64)
    for i in range(4):
        s.add(lora_group(f"r{i}", i + 1))
    assert len(fake_step(s).seqs) == 4


def test_prefix_cache_roots_keep_adapters_apart() -> None:
    bm = BlockSpaceManager(4, 32, 0, watermark=0.0, enable_caching=True)
    tokens = list(range(3, 20))
    first = lora_group("a", 1, tokens=tokens)
    bm.allocate(first)
    seq = first.seqs[0]
    seq.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)
    same = lora_group("a-again", 1, tokens=tokens)
    other = lora_group("b", 2, tokens=tokens)
    base = lora_group("base", None, tokens=tokens)
    assert bm.num_cached_prefix_tokens(same.seqs[0]) == 16
    assert bm.num_cached_prefix_tokens(other.seqs[0]) == 0
    assert bm.num_cached_prefix_tokens(base.seqs[0]) == 0
