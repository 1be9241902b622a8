"""The unpack schedule: recorded order, fallbacks, and what does not disturb a recording."""

from __future__ import annotations

from tierstore.tiers.schedule import Schedule


def _step(s: Schedule, keys: list[int], unpack: list[int], sig: str = "f32") -> list[int]:
    for key in keys:
        s.packed(key, sig)
    s.unpacked(unpack[0])
    plan = []
    while (key := s.next_planned()) is not None:
        plan.append(key)
    for key in unpack[1:]:
        s.unpacked(key)
    return plan


def test_first_step_plans_reverse_pack_order() -> None:
    s = Schedule()
    assert _step(s, [0, 1, 2, 3], [3, 2, 1, 0]) == [3, 2, 1, 0]
    assert s.plan_source == "reverse"


def test_recorded_order_is_replayed_for_the_same_sequence() -> None:
    s = Schedule()
    _step(s, [0, 1, 2, 3], [2, 3, 0, 1])
    assert _step(s, [10, 11, 12, 13], [12, 13, 10, 11]) == [12, 13, 10, 11]
    assert s.plan_source == "recorded"


def test_a_different_sequence_falls_back_to_reverse() -> None:
    s = Schedule()
    _step(s, [0, 1, 2], [1, 2, 0])
    assert _step(s, [5, 6, 7, 8], [8, 7, 6, 5]) == [8, 7, 6, 5]  # another count
    assert s.plan_source == "reverse"
    _step(s, [0, 1, 2, 3], [1, 0, 3, 2], sig="f32")
    assert _step(s, [4, 5, 6, 7], [7, 6, 5, 4], sig="bf16") == [7, 6, 5, 4]  # another dtype
    assert s.plan_source == "reverse"


def test_repeated_and_missing_unpacks() -> None:
    s = Schedule()
    # Entry 1 is unpacked twice (retain_graph, or two handles); entry 0 never.
    _step(s, [0, 1, 2], [2, 1, 1, 2])
    # The recording keeps first unpacks only; the unseen entry goes last.
    assert _step(s, [3, 4, 5], [5, 4, 3]) == [5, 4, 3]
    assert s.plan_source == "recorded"


def test_packs_during_backward_start_a_new_step() -> None:
    s = Schedule()
    for key in (0, 1):
        s.packed(key, "f32")
    s.unpacked(1)
    assert s.unpacking
    s.packed(2, "f32")  # the next forward began
    assert not s.unpacking
    s.unpacked(2)
    assert s.next_planned() == 2 and s.next_planned() is None
