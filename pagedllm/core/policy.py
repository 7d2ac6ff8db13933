"""Orderings of sequence groups: who is served first, and who is preempted first (the last)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from pagedllm.core.sequence import SequenceGroup

SortKey = Callable[[SequenceGroup], tuple[float, ...]]


def fcfs_key(group: SequenceGroup) -> tuple[float, ...]:
    return (group.arrival_time,)


def priority_key(group: SequenceGroup) -> tuple[float, ...]:
    """Lower ``priority`` runs first; ties go to the earlier arrival."""
    return (group.priority, group.arrival_time)


POLICIES: dict[str, SortKey] = {"fcfs": fcfs_key, "priority": priority_key}


def sort_groups(groups: Iterable[SequenceGroup], key: SortKey) -> deque[SequenceGroup]:
    return deque(sorted(groups, key=key))
