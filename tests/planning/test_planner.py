"""The planner (issue 21): a pure function, tested on synthetic profiles."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from tierstore.planning import planner
from tierstore.planning.plan_types import _size
from tierstore.planning.planner import (
    _CHOICES,
    ONE_AT_A_TIME,
    SYNCHRONOUS,
    Choice,
    Profile,
    Save,
    _MoveBounds,
    default_plan,
    floor_bytes,
    from_graph,
    hands_heap_back,
    kept_whole,
    make_plan,
    offloaded_saves,
    recorded_rebuilds,
    replayed,
    simulate,
    tied,
)

GIB = 1 << 30
MIB = 1 << 20

# NOTE [ The H100 step ]
# Issue 21's measured step: a GPT of 12 blocks (d 2048, 16 heads, seq 2048,
# batch 4, bf16) on one H100, 71 ms a step without offload; each block saves
# about 0.47 GiB in about 1.25 ms of forward; backward takes about twice
# forward; PCIe moves 55 GB/s out and 52 GB/s back. Each block saves, in
# forward order, with the op that made it and what a rebuild replays (FLOPs
# at TFLOPS, or bytes read and written at HBM for memory-bound ops):
#   x     the block's input  add(x2 of the last block, fc2(gelu))  fc2's matmul
#   h1    layer norm of x    memory-bound
#   qkv   h1 @ W_qkv         2 * 8192 * 2048 * 6144 FLOPs
#   attn  causal attention   2 * b * s^2 * d FLOPs (half of 4bs^2d: causal)
#   x2    x + proj(attn)     the projection's 2 * 8192 * 2048^2
#   h2    layer norm of x2   memory-bound
#   fc1   h2 @ W_1           2 * 8192 * 2048 * 8192
#   gelu  gelu(fc1)          memory-bound
# in units of one activation (b * s * d bf16 = 32 MiB, scaled so that a
# block is 0.47 GiB): 1, 1, 3, 1, 1, 1, 4, 4; each op's share of the block's
# 1.25 ms is its share of the block's rebuild cost. The head saves the final
# norm's output. Memory is BASE (parameters, gradients, optimizer state and
# the head's and loss's working tensors) plus the saved bytes resident at the
# plan's peak. BASE is set so that checkpointing every block (block inputs
# kept, the rest rebuilt) comes out where the issue measured it, 0.37x of no
# offload's memory; its time, 1.21x, then follows from the FLOPs:
# test_checkpointing_every_block checks both figures, so the model is
# calibrated on the issue's step. torch.utils.checkpoint replays a block's
# whole forward, fc2 too, which this model counts as the next block's x: a
# plan rebuilds only what backward needs, so it never replays fc2 for
# nothing (_torch_checkpoint adds it back for the comparison).
TFLOPS = 600e12
HBM = 3.0e12
BLOCKS = 12
UNIT = int(0.47 * GIB / 16)
SAVED = BLOCKS * 16 * UNIT + UNIT
BASE = int(0.2675 / 0.7325 * SAVED)  # BASE is 0.2675x of no offload's memory
NONE_BYTES = BASE + SAVED
FORWARD_BLOCK_S = 1.25e-3
STEP_S = 71e-3


def _h100_profile(
    unit: int = UNIT,
    forward_block_s: float = FORWARD_BLOCK_S,
    step_s: float = STEP_S,
    read_bytes_per_s: float = 52e9,
) -> Profile:
    """The H100 step (NOTE [ The H100 step ]); the arguments make the H200's."""
    mm = {
        "x": 2 * 8192 * 8192 * 2048 / TFLOPS,  # fc2: 4d to d
        "qkv": 2 * 8192 * 2048 * 6144 / TFLOPS,
        "attn": 2 * 4 * 2048**2 * 2048 / TFLOPS,
        "x2": 2 * 8192 * 2048 * 2048 / TFLOPS,  # proj
        "fc1": 2 * 8192 * 2048 * 8192 / TFLOPS,
    }
    units = {"x": 1, "h1": 1, "qkv": 3, "attn": 1, "x2": 1, "h2": 1, "fc1": 4, "gelu": 4}
    ops = {
        "x": "aten.add",
        "h1": "aten.native_layer_norm",
        "qkv": "aten.mm",
        "attn": "aten._scaled_dot_product_flash_attention",
        "x2": "aten.add",
        "h2": "aten.native_layer_norm",
        "fc1": "aten.mm",
        "gelu": "aten.gelu",
    }
    # Forward time of each save's op: its FLOPs' share of the block's 1.25 ms.
    share = {n: mm.get(n, 2 * units[n] * unit / HBM) for n in units}
    scale = forward_block_s / sum(share.values())
    forward = forward_block_s * BLOCKS
    head_forward = 0.8e-3
    backward = 2 * (forward + head_forward)
    saves: list[Save] = []
    t = 0.0
    for b in range(BLOCKS):
        first = len(saves)
        index = {n: first + k for k, n in enumerate(units)}
        for name, size in units.items():
            t += share[name] * scale
            inputs: tuple[int, ...] = {
                "x": (first - 4, first - 1) if b else (),
                "h1": (index["x"],),
                "qkv": (index["h1"],),
                "attn": (index["qkv"],),
                "x2": (index["x"], index["attn"]),
                "h2": (index["x2"],),
                "fc1": (index["h2"],),
                "gelu": (index["fc1"],),
            }[name]
            saves.append(
                Save(
                    nbytes=size * unit,
                    op=ops[name],
                    module=f"blocks.{b}",
                    forward_s=t,
                    use_s=backward - 2 * t - 2 * head_forward,
                    rebuild_s=share[name] * scale if b or name != "x" else 2 * unit / HBM,
                    inputs=inputs,
                )
            )
    t += head_forward
    saves.append(Save(unit, "aten.native_layer_norm", "head", t, 0.0, None, ()))
    return Profile(
        saves=tuple(saves),
        forward_s=t,
        backward_s=backward,
        other_s=step_s - t - backward,
        write_bytes_per_s=55e9,
        read_bytes_per_s=read_bytes_per_s,
        window_bytes=256 * MIB,
    )


def _budget(memory: float) -> int:
    """The activation budget that makes the step's memory ``memory`` x no offload's."""
    return int(memory * NONE_BYTES - BASE)


def test_h100_profile_is_the_issue_step() -> None:
    profile = _h100_profile()
    keep_all = simulate(profile, ("keep",) * len(profile.saves), profile.window_bytes)
    assert keep_all.step_s == pytest.approx(STEP_S)
    assert (BASE + keep_all.peak_bytes) / NONE_BYTES == pytest.approx(1.0, abs=0.01)


def _checkpoint_first(profile: Profile, n: int) -> tuple[Choice, ...]:
    """torch.utils.checkpoint on the first ``n`` blocks: their inputs kept, the rest rebuilt."""
    return tuple(
        "rebuild" if i // 8 < n and i % 8 and s.module != "head" else "keep"
        for i, s in enumerate(profile.saves)
    )


def _torch_checkpoint(profile: Profile, choices: tuple[Choice, ...]) -> float:
    """The step time of ``choices`` (blocks rebuilt from their inputs) as torch.utils.checkpoint
    runs them: each rebuilt block's replay also runs its fc2, the next block's x."""
    blocks = {i // 8 for i, c in enumerate(choices) if c == "rebuild"}
    fc2 = profile.saves[8].rebuild_s  # block 1's x: block 0's fc2 and residual add
    assert fc2 is not None
    return simulate(profile, choices, profile.window_bytes).step_s + len(blocks) * fc2


def test_checkpointing_every_block() -> None:
    # The calibration (NOTE [ The H100 step ]): the issue measured 0.37x and 1.21x.
    profile = _h100_profile()
    every = _checkpoint_first(profile, BLOCKS)
    out = simulate(profile, every, profile.window_bytes)
    assert (BASE + out.peak_bytes) / NONE_BYTES == pytest.approx(0.37, abs=0.005)
    assert _torch_checkpoint(profile, every) / STEP_S == pytest.approx(1.21, abs=0.01)
    # and the first 6 blocks: measured 0.68x at 1.10x
    half = _checkpoint_first(profile, 6)
    out = simulate(profile, half, profile.window_bytes)
    assert (BASE + out.peak_bytes) / NONE_BYTES == pytest.approx(0.68, abs=0.03)
    assert _torch_checkpoint(profile, half) / STEP_S == pytest.approx(1.10, abs=0.01)


@pytest.mark.parametrize("n", range(1, BLOCKS + 1))
def test_faster_than_checkpointing_at_its_memory(n: int) -> None:
    profile = _h100_profile()
    checkpointed = simulate(profile, _checkpoint_first(profile, n), profile.window_bytes)
    plan = make_plan(profile, checkpointed.peak_bytes)
    assert plan.fits
    assert plan.predicted_step_s <= checkpointed.step_s
    assert plan.predicted_step_s == simulate(profile, plan.choices, plan.window_bytes).step_s


def test_h100_within_2_percent_at_075x() -> None:
    plan = make_plan(_h100_profile(), _budget(0.75))
    assert plan.fits
    assert plan.predicted_step_s / STEP_S <= 1.02


def _checkpoint_and_offload(profile: Profile) -> tuple[Choice, ...]:
    """Every block checkpointed, its input offloaded: the lowest memory in the issue's table."""
    return tuple(
        "keep" if s.module == "head" else "offload" if i % 8 == 0 else "rebuild"
        for i, s in enumerate(profile.saves)
    )


def test_h100_within_15_percent_where_checkpointing_plus_offload_reaches() -> None:
    # The issue's lowest measured memory (every block checkpointed plus offload,
    # 1.22x there and in this model): the planner is within 1.15x.
    profile = _h100_profile()
    choices = _checkpoint_and_offload(profile)
    lowest = simulate(profile, choices, profile.window_bytes)
    assert _torch_checkpoint(profile, choices) / STEP_S == pytest.approx(1.22, abs=0.01)
    plan = make_plan(profile, lowest.peak_bytes)
    assert plan.fits
    assert plan.predicted_step_s / STEP_S <= 1.15


def test_h100_near_the_floor_is_not_everything_offloaded() -> None:
    # 0.31x is below what a rebuilt MLP (h2, fc1 and gelu at once) leaves room
    # for beside the reads in flight: one save at a time from keep-all gets
    # stuck there and everything offloaded (3.5x) was the only plan that fit.
    # The second pass (planner._take_back) rebuilds from that plan what the
    # budget allows (1.55x).
    plan = make_plan(_h100_profile(), _budget(0.31))
    assert plan.fits
    assert plan.predicted_step_s / STEP_S < 2.0
    assert plan.bytes_by_choice()["rebuild"] > plan.bytes_by_choice()["offload"]


def _lower_bound(
    profile: Profile,
    budget: int,
    never_rebuilt: frozenset[int] = frozenset(),
    resident: frozenset[int] = frozenset(),
) -> float:
    """No plan of ``profile`` within ``budget`` is faster than this, in this model.

    At backward's first use every save is resident but the ones offloaded
    and already written (at most what the link moved during forward, more
    only by stalling forward or backward: a second per write_bytes_per_s
    bytes) and the ones rebuilt (each costs its op's compute, never hidden;
    none of ``never_rebuilt``); ``resident`` are resident there whatever
    their choice (the save that use reads). The cheapest mix of the three
    that frees what the budget asks, taken fractionally, is a bound on the
    step.
    """
    need = profile.saved_bytes - budget - profile.write_bytes_per_s * profile.forward_s
    stall = 1 / profile.write_bytes_per_s  # seconds a byte, moved by stalling forward
    per_byte = sorted(
        (s.rebuild_s / s.nbytes, s.nbytes)
        for i, s in enumerate(profile.saves)
        if s.rebuild_s is not None and i not in never_rebuilt | resident
    )
    cost = 0.0
    for price, nbytes in [*per_byte, (stall, math.inf)]:
        if need <= 0:
            break
        cost += min(price, stall) * min(need, nbytes)
        need -= nbytes
    return profile.other_s + profile.forward_s + profile.backward_s + cost


def _first_used(profile: Profile) -> frozenset[int]:
    """The block save backward uses first, at its start: the last block's gelu.

    fc2's backward reads it before any other backward compute has run (the
    head's save, used at the same moment, cannot be rebuilt anyway). It is
    resident then, kept, read back or rebuilt, so no plan frees its bytes by
    backward's start, and they are among the cheapest to rebuild.
    """
    first = next(i for i in profile.use_order if profile.saves[i].module != "head")
    assert profile.saves[first].use_s == pytest.approx(0.0, abs=1e-12)
    assert (profile.saves[first].op, first) == ("aten.gelu", 8 * BLOCKS - 1)
    return frozenset({first})


@pytest.mark.parametrize("memory", [0.75, 0.6, 0.5, 0.45, 0.4, 0.37])
def test_h100_within_one_percent_of_the_bound(memory: float) -> None:
    profile = _h100_profile()
    plan = make_plan(profile, _budget(memory))
    bound = _lower_bound(profile, _budget(memory), resident=_first_used(profile))
    assert plan.fits
    assert bound <= plan.predicted_step_s <= 1.01 * bound


def test_the_first_use_tightens_the_bound() -> None:
    # Not a free refinement: with the last gelu's 4 activations out of the
    # cheapest bytes, at 0.37x matmul and attention bytes (3 ms/GiB) free them.
    profile = _h100_profile()
    loose = _lower_bound(profile, _budget(0.37))
    tight = _lower_bound(profile, _budget(0.37), resident=_first_used(profile))
    assert tight - loose == pytest.approx(4 * UNIT * 3e-3 / GIB, rel=0.3)


def test_h100_half_memory_target_is_below_the_bound() -> None:
    # Issue 21 asks for 1.05x at 0.5x: at 0.5x 3.3 GiB must go by backward's
    # start; the link moves 0.8 GiB of it during forward, the norms and gelu
    # (2.1 GiB) are rebuilt in 1.2 ms, and the rest costs what matmuls and
    # attention cost per byte (3 ms/GiB): 1.056x at best, whatever the plan,
    # 1.060x with the last gelu resident at backward's first use.
    profile = _h100_profile()
    assert _lower_bound(profile, _budget(0.5)) / STEP_S > 1.05
    assert _lower_bound(profile, _budget(0.5), resident=_first_used(profile)) / STEP_S > 1.055


def test_h100_lowest_memory_target_is_below_the_bound() -> None:
    # Issue 21 asks for 1.15x at 0.30x, 8.6 activations of budget. Rebuilding
    # a block's gelu reads its fc1 and rebuilding fc1 reads h2; both live
    # until their use, so a block whose fc1 and gelu are both rebuilt holds
    # 9 activations at gelu's use: over the budget. Keeping either holds 4 at
    # backward's start, which at most 2 blocks can. So in 10 blocks fc1 or
    # gelu is offloaded, not rebuilt; at best it is fc1, dearer to rebuild.
    # Freeing the rest by rebuilds and stalls costs 1.196x at least; 1.227x
    # with the last block's gelu resident at backward's first use.
    profile = _h100_profile()
    budget = _budget(0.30)
    assert budget < 9 * UNIT
    keeping = budget // (4 * UNIT)
    fc1 = frozenset(8 * b + 6 for b in range(BLOCKS - keeping))
    assert {profile.saves[i].nbytes for i in fc1} == {4 * UNIT}
    bound = _lower_bound(profile, budget, never_rebuilt=fc1, resident=_first_used(profile))
    assert bound / STEP_S > 1.22
    plan = make_plan(profile, budget)
    assert plan.fits
    assert bound <= plan.predicted_step_s


def test_h100_target_at_037x_is_below_the_bound() -> None:
    # Issue 21 asks for 1.10x at 0.37x. Freeing what the budget asks at
    # backward's start from the cheapest bytes (norms and gelu first, then
    # matmuls and attention, then stalls) costs 1.0985x; but backward's first
    # use reads the last block's gelu, resident then whatever the plan, and
    # freeing its 4 activations from the next cheapest bytes instead makes
    # it 1.1026x at best. The planner's 1.109x is within 0.6% of that.
    profile = _h100_profile()
    budget = _budget(0.37)
    assert _lower_bound(profile, budget) / STEP_S < 1.10
    bound = _lower_bound(profile, budget, resident=_first_used(profile))
    assert bound / STEP_S > 1.10
    plan = make_plan(profile, budget)
    assert plan.fits
    assert bound <= plan.predicted_step_s <= 1.006 * bound


def test_floor_is_about_030x() -> None:
    profile = _h100_profile()
    plan = make_plan(profile, 0)
    assert not plan.fits
    assert plan.predicted_peak_bytes == plan.floor_bytes
    # BASE (0.2675x) and two fc1-sized copies: one in use, and the read the
    # store keeps in flight behind it however small the window (NOTE [ Prefetch ]
    # in tierstore/tiers/readahead.py): 0.298x. PCIe has no SYNCHRONOUS window.
    assert 0.29 < (BASE + plan.floor_bytes) / NONE_BYTES < 0.30
    assert plan.floor_bytes == 8 * UNIT
    assert plan.window_bytes != SYNCHRONOUS


def test_the_last_resorts_only_where_nothing_else_fits() -> None:
    # 64 MiB, then eight saves of 4 MiB, through a 16 MiB window (the only one
    # tried: the largest save is above it). At its small saves' uses a window
    # holds 16 MiB of reads; one copy at a time holds the read in use and the
    # one the store keeps in flight behind it (NOTE [ Prefetch ]).
    sizes = [64, 4, 4, 4, 4, 4, 4, 4, 4]
    saves = tuple(
        Save(n * MIB, "aten.mm", f"m.{i}", 0.01 * (i + 1), 0.02 * (8 - i))
        for i, n in enumerate(sizes)
    )
    pcie = Profile(saves, 0.09, 0.18, 0.0, 1e9, 1e9, 16 * MIB)
    assert make_plan(pcie, 80 * MIB).window_bytes == 16 * MIB
    plan = make_plan(pcie, 72 * MIB)
    assert (plan.fits, plan.window_bytes, plan.predicted_peak_bytes) == (
        True,
        ONE_AT_A_TIME,
        72 * MIB,
    )
    assert make_plan(pcie, 64 * MIB).floor_bytes == 68 * MIB  # PCIe: forward never waits
    # A disk's link: each save waits for its own write, each use reads on
    # demand: only the read in use is resident, at the price of every copy.
    disk = dataclasses.replace(pcie, shared_link=True)
    assert make_plan(disk, 72 * MIB).window_bytes == ONE_AT_A_TIME
    plan = make_plan(disk, 64 * MIB)
    assert (plan.fits, plan.window_bytes, plan.predicted_peak_bytes) == (
        True,
        SYNCHRONOUS,
        64 * MIB,
    )
    assert plan.predicted_step_s > make_plan(disk, 72 * MIB).predicted_step_s
    # The H100 step from a disk fits 4.5 activations only so; its 0.30x over
    # PCIe needs neither.
    h100_disk = dataclasses.replace(_h100_profile(), shared_link=True)
    assert make_plan(h100_disk, int(4.5 * UNIT)).window_bytes == SYNCHRONOUS
    assert make_plan(_h100_profile(), _budget(0.30)).window_bytes > ONE_AT_A_TIME


def test_a_window_below_the_largest_save_leaves_room_for_rebuilds() -> None:
    # At 0.33x a window that holds an fc1 copy (4 activations) and more takes
    # the room a rebuilt attention needs beside the reads: the best plan with
    # one was 1.40x. A window of half of fc1 reads one fc1 at a time and
    # leaves that room: 1.12x.
    profile = _h100_profile()
    plan = make_plan(profile, _budget(0.33))
    assert plan.fits
    assert plan.window_bytes < max(s.nbytes for s in profile.saves)
    assert plan.predicted_step_s / STEP_S < 1.13


def test_windows_above_every_byte_saved_are_searched_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A small model under the default window (256 MiB) saves less than most of
    # the windows tried: none of those ever fills, so each plays every plan
    # alike, and only the largest is searched (bench overhead's 401 saves
    # took 10.0 s to plan with the nine windows this profile had).
    profile = _chain(8, nbytes=MIB)  # 8 MiB saved in all
    windows = planner._windows(profile)
    assert [w for w in windows if w > 8 * MIB] == [profile.window_bytes]
    rng = random.Random(0)
    for _ in range(50):
        choices = tuple(rng.choice(_CHOICES) for _ in profile.saves)
        assert simulate(profile, choices, 8 * MIB + 1) == simulate(profile, choices, 256 * MIB)
    plans = {}
    for extra in ([], [128 * MIB, 64 * MIB, 16 * MIB]):  # the windows tried before
        with monkeypatch.context() as patch:
            patch.setattr(
                planner, "_windows", lambda p, extra=extra: sorted({*windows, *extra}, reverse=True)
            )
            plan = make_plan(profile, 3 * MIB)
        plans[len(extra)] = (plan.choices, plan.window_bytes, plan.predicted_step_s)
    assert plans[0] == plans[3]


def test_a_start_that_fits_prices_no_move() -> None:
    # Every start that already fits its budget was priced move by move, one
    # simulation each, before the search saw that it had nothing to do.
    profile = _chain(4)
    start = ["keep"] * 4
    outcome = simulate(profile, tuple(start), profile.window_bytes)

    def price(i: int, choice: Choice, now: planner.Outcome) -> None:
        raise AssertionError(f"priced save {i} to {choice}")

    done = planner._greedy(
        start,
        outcome,
        moves=[(i, "offload") for i in range(4)],
        price=price,
        done=lambda o: o.peak_bytes <= 400 * MIB,
    )
    assert done == (outcome, False) and start == ["keep"] * 4


def test_a_move_taken_keeps_the_outcome_its_price_played(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Taking a move played its choices again, the same simulation its price
    # had just run: one in five of a search's simulations.
    profile = _chain(4)
    play = simulate
    choices: list[Choice] = ["keep"] * 4
    played: list[tuple[Choice, ...]] = []

    def price(
        i: int, choice: Choice, now: planner.Outcome
    ) -> tuple[tuple[float, float], planner.Outcome]:
        trial = choices.copy()
        trial[i] = choice
        played.append(tuple(trial))
        return (float(i), 0.0), play(profile, tuple(trial), profile.window_bytes)

    monkeypatch.setattr(planner, "simulate", None)  # _greedy plays nothing itself
    outcome, changed = planner._greedy(
        choices,
        play(profile, tuple(choices), profile.window_bytes),
        moves=[(i, "offload") for i in range(4)],
        price=price,
        done=lambda o: o.peak_bytes <= 350 * MIB,
    )
    taken = choices.count("offload")
    assert changed and choices == ["offload"] * taken + ["keep"] * (4 - taken)
    assert outcome == play(profile, tuple(choices), profile.window_bytes)
    assert len(played) == 4 + taken  # each move priced once, and again as it comes up


def _chain(n: int, *, rebuild_s: float | None = 0.001, nbytes: int = 100 * MIB) -> Profile:
    """``n`` saves of ``nbytes``, 10 ms of forward apart, backward twice forward."""
    saves = tuple(
        Save(nbytes, "aten.mm", f"m.{i}", 0.01 * (i + 1), 0.02 * (n - 1 - i), rebuild_s)
        for i in range(n)
    )
    return Profile(saves, 0.01 * n, 0.02 * n, 0.0, 20e9, 20e9, 256 * MIB)


def test_a_budget_that_holds_everything_keeps_everything() -> None:
    profile = _chain(8)
    plan = make_plan(profile, profile.saved_bytes + profile.window_bytes)
    assert plan.choices == ("keep",) * 8
    assert plan.predicted_step_s == pytest.approx(0.24)
    assert plan.predicted_peak_bytes == 800 * MIB


def test_offload_goes_to_the_earliest_saves_and_never_to_what_backward_needs_first() -> None:
    plan = make_plan(_chain(8, rebuild_s=None), 600 * MIB)
    assert plan.fits
    assert plan.choices[-1] == "keep"  # backward's first use: a copy could not hide
    offloaded = [i for i, c in enumerate(plan.choices) if c == "offload"]
    assert offloaded == list(range(len(offloaded)))
    assert plan.predicted_step_s == pytest.approx(0.24)  # every copy hidden


def test_what_cannot_be_rebuilt_is_never_rebuilt() -> None:
    profile = _chain(8, rebuild_s=None)
    for budget in (0, 100 * MIB, 400 * MIB):
        assert "rebuild" not in make_plan(profile, budget).choices


def test_rebuilds_cheapest_per_byte_first() -> None:
    saves = (
        Save(100 * MIB, "aten.mm", "a", 0.01, 0.03, 0.010),
        Save(100 * MIB, "aten.gelu", "b", 0.02, 0.02, 0.001),
        Save(100 * MIB, "aten.mm", "c", 0.03, 0.01, 0.010),
    )
    no_link = Profile(saves, 0.03, 0.06, 0.0, 1e3, 1e3, 256 * MIB)  # copies take ages
    plan = make_plan(no_link, 200 * MIB)
    assert plan.choices == ("keep", "rebuild", "keep")
    assert plan.predicted_step_s == pytest.approx(0.091)


def test_a_budget_below_the_floor_gets_the_lowest_peak() -> None:
    plan = make_plan(_chain(4, rebuild_s=None), 0)
    assert not plan.fits
    # When backward starts, the last save's copy out is still under way and
    # its read is in flight; by the time backward uses it, the copy out has
    # landed, and the store keeps the next read in flight behind it (NOTE
    # [ Prefetch ]): two saves' bytes over PCIe, one from a disk, which reads
    # each on demand (SYNCHRONOUS).
    assert plan.floor_bytes == 200 * MIB
    assert plan.predicted_peak_bytes == plan.floor_bytes
    disk = make_plan(dataclasses.replace(_chain(4, rebuild_s=None), shared_link=True), 0)
    assert (disk.floor_bytes, disk.window_bytes) == (100 * MIB, SYNCHRONOUS)


def test_the_table() -> None:
    disk = dataclasses.replace(_chain(2, rebuild_s=None, nbytes=MIB), shared_link=True)
    plan = make_plan(disk, 0)
    plan.measured_step_s = 0.0612
    plan.measured_peak_bytes = MIB
    assert str(plan).splitlines() == [
        "module        kept   offloaded     rebuilt    exposed",
        "m.0            0 B     1.0 MiB         0 B      0.1ms",
        "m.1            0 B     1.0 MiB         0 B      0.1ms",
        "budget 0 B (not met: this plan's peak is 1.0 MiB), window none (synchronous), "
        "floor 1.0 MiB; link out 20 GB/s, back 20 GB/s",
        "step: predicted 0.06021 s, measured 0.0612 s; peak: predicted 1.0 MiB, measured 1.0 MiB",
        "(kept / offloaded / rebuilt: the bytes each module saves, by the plan's choice; "
        "exposed: the step time the plan charges to them, link waits and rebuild compute; "
        "window: copies in flight each way; floor: the lowest peak the step can reach)",
    ]


def _random_profile(rng: random.Random) -> Profile:
    """A small made-up step: saves of mixed sizes, some not rebuildable, some built on others."""
    n = rng.randint(4, 24)
    forward = 0.0
    made = []
    for i in range(n):
        forward += rng.uniform(1e-4, 3e-3)
        nbytes = rng.choice([1, 2, 4, 8]) * rng.randint(1, 8) * MIB
        rebuild = None if rng.random() < 0.2 else rng.uniform(1e-5, 2e-3)
        inputs = tuple(sorted(rng.sample(range(i), min(i, rng.randint(0, 2)))))
        made.append((nbytes, forward, rebuild, inputs))
    backward = 2 * forward
    saves = tuple(
        Save(nbytes, "aten.mm", f"m.{i * 3 // n}", at, backward * (1 - at / forward), rebuild, ins)
        for i, (nbytes, at, rebuild, ins) in enumerate(made)
    )
    return Profile(
        saves,
        forward,
        backward,
        rng.uniform(0, 0.01),
        rng.choice([2e9, 10e9]),
        rng.choice([2e9, 10e9]),
        rng.choice([8, 64]) * MIB,
        moved_s_per_byte=rng.choice([0.0, 1e-11]),
        moved_s_per_save=rng.choice([0.0, 5e-4]),
        fixed_bytes=rng.choice([0, 16 * MIB]),
        shared_link=rng.random() < 0.5,
    )


def test_no_plan_is_slower_than_offloading_everything_where_that_fits() -> None:
    # NOTE [ The default is a plan ] (issue 54, item 7): a store without a
    # budget offloads every save through the default window. Priced from the
    # profile, where its peak fits the budget, the budget's plan is at least
    # as fast; where it does not, the budget is below the default's bytes in
    # flight.
    rng = random.Random(54)
    compared = below = 0
    for _ in range(80):
        profile = _random_profile(rng)
        default = simulate(profile, ("offload",) * len(profile.saves), profile.window_bytes)
        total = sum(s.nbytes for s in profile.saves)
        for fraction in (0.1, 0.2, 0.35, 0.5, 0.75):
            budget = int(fraction * total)
            plan = make_plan(profile, budget)
            if default.peak_bytes <= budget:
                assert plan.fits and plan.predicted_step_s <= default.step_s
                compared += 1
            else:
                below += 1
    assert compared > 50 and below > 50


def rebuilds_priced_cheaper() -> Profile:
    """Four 1 MiB saves a rebuild prices below their trip out and back; a 1 MiB window."""
    saves = tuple(
        Save(MIB, "aten.mm", module, 0.1 * (i + 1), 0.1 * (4 - i), 0.01)
        for i, module in enumerate("aabb")
    )
    return Profile(saves, 0.5, 0.5, 0.0, 1e8, 1e8, MIB, moved_s_per_byte=1e-8, shared_link=True)


def test_the_default_once_measured_is_priced_at_its_measurement() -> None:
    # NOTE [ The default is a plan ]: a trial step of the default puts its
    # time in the profile, and every search after prices it at that, at the
    # profile's window only; a trial above the budget rules it out.
    profile = rebuilds_priced_cheaper()
    budget = int(2.5 * MIB)
    searched = make_plan(profile, budget)
    assert searched.choices == ("rebuild", "rebuild", "keep", "keep")
    default = ("offload",) * 4
    priced = simulate(profile, default, MIB)
    assert priced.peak_bytes <= budget and priced.step_s > searched.predicted_step_s
    measured = dataclasses.replace(profile, default_step_s=0.9)
    assert simulate(measured, default, MIB).step_s == 0.9
    narrow = simulate(profile, default, MIB // 2).step_s  # another window: simulated
    assert simulate(measured, default, MIB // 2).step_s == narrow
    assert simulate(measured, ("keep", *default[1:]), MIB).step_s != 0.9
    plan = make_plan(measured, budget)
    assert plan.choices == default and plan.window_bytes == MIB
    assert plan.predicted_step_s == 0.9
    ruled_out = dataclasses.replace(profile, default_step_s=math.inf)
    assert default_plan(ruled_out, budget, 0) is None
    assert make_plan(ruled_out, budget).choices == searched.choices
    assert default_plan(profile, MIB, 0) is None  # its window holds more than 1 MiB


def test_a_move_saves_no_more_than_its_bound() -> None:
    # The second pass skips, unsimulated, the moves _MoveBounds says cannot
    # pay: that is sound only if no move ever saves more than its bound, and
    # if nothing kept ever rests below the peak.
    rng = random.Random(21)
    checked = 0
    for _ in range(60):
        profile = _random_profile(rng)
        choices: list[Choice] = [
            rng.choice(_CHOICES if s.rebuild_s is not None else ("keep", "offload"))
            for s in profile.saves
        ]
        window = rng.choice([profile.window_bytes, 1])
        now = simulate(profile, tuple(choices), window)
        bounds = _MoveBounds(profile, choices)
        assert bounds.kept_bytes(now) <= now.peak_bytes
        for i, save in enumerate(profile.saves):
            for choice in _CHOICES:
                if choice == choices[i] or (choice == "rebuild" and save.rebuild_s is None):
                    continue
                trial = list(choices)
                trial[i] = choice
                saved = now.step_s - simulate(profile, tuple(trial), window).step_s
                assert saved <= bounds.most_saved(i, choice, now) + 1e-12
                checked += 1
    assert checked > 1000


def test_a_copy_out_still_going_in_backward_counts_until_it_lands() -> None:
    # A's copy out takes 0.1 s, into backward; R, rebuilt from K at its use,
    # peaks while it is still going: K, R, and A twice (its source still
    # queued, its read already issued).
    saves = (
        Save(100 * MIB, "aten.mm", "a", 0.001, 0.050),
        Save(1 * MIB, "aten.mm", "k", 0.002, 0.002),
        Save(200 * MIB, "aten.gelu", "r", 0.003, 0.001, rebuild_s=0.001, inputs=(1,)),
        Save(1 * MIB, "aten.mm", "s", 0.004, 0.0),
    )
    profile = Profile(saves, 0.004, 0.06, 0.0, 100 * MIB / 0.1, 1e12, 1 << 30)
    out = simulate(profile, ("offload", "keep", "rebuild", "keep"), 1 << 30)
    assert out.peak_bytes == (1 + 200 + 100 + 100) * MIB


def test_a_read_made_on_demand_is_held_until_its_use() -> None:
    # R is rebuilt from A and Q, Q from B. Backward needs B first (for Q),
    # while the window (one save) holds A's read ahead: B is read on demand
    # and, as the store holds it (ReadAhead.from_disk), stays until its use.
    # At R's use: A, B, Q and R.
    saves = (
        Save(100, "aten.mm", "m", 0.1, 0.3),
        Save(100, "aten.mm", "m", 0.2, 0.2),
        Save(100, "aten.gelu", "m", 0.3, 0.1, rebuild_s=0.01, inputs=(1,)),
        Save(100, "aten.add", "m", 0.4, 0.0, rebuild_s=0.01, inputs=(0, 2)),
    )
    profile = Profile(saves, 0.5, 1.0, 0.0, 1e6, 1e6, 100)
    out = simulate(profile, ("offload", "offload", "rebuild", "rebuild"), 100)
    assert out.peak_bytes == 400


def test_a_full_window_still_has_the_next_read_in_flight() -> None:
    # As the store tops up (NOTE [ Prefetch ]): while A (the window's worth)
    # is in use, B's read is already under way, and lands before B's use.
    saves = (Save(100, "aten.mm", "b", 0.1, 0.2), Save(100, "aten.mm", "a", 0.2, 0.0))
    profile = Profile(saves, 0.2, 0.4, 0.0, 1e9, 1000.0, 100)
    out = simulate(profile, ("offload", "offload"), 100)
    assert out.peak_bytes == 200
    # A's read waits for the link from backward's start (0.1 s); B's follows
    # it and is done by B's use, 0.2 s of backward later.
    assert out.exposed_s == (0.0, pytest.approx(0.1))
    # No window: each read on demand, one at a time, each waited for.
    sync = simulate(dataclasses.replace(profile, shared_link=True), ("offload", "offload"), 0)
    assert sync.peak_bytes == 100
    assert sync.exposed_s == (pytest.approx(0.1 + 1e-7), pytest.approx(0.1 + 1e-7))


def test_a_budget_everything_fits_is_planned_without_a_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing is faster than keeping every save: the first plan of a shape,
    # made on the training thread, costs one simulation per template then.
    profile = _chain(8)
    everything = simulate(profile, ("keep",) * 8, profile.window_bytes).peak_bytes

    def searched(*args: object) -> object:
        raise AssertionError("searched a plan for a budget everything fits")

    with monkeypatch.context() as patch:
        patch.setattr(planner, "_plan_for_window", searched)
        plan = make_plan(profile, everything)
    assert plan.choices == ("keep",) * 8 and plan.predicted_peak_bytes == everything
    # The floor is the step's all the same (NOTE [ The floor ]).
    assert plan.floor_bytes == make_plan(profile, 0).floor_bytes == floor_bytes(profile)
    assert make_plan(profile, everything - 1).choices != plan.choices


@pytest.mark.parametrize("shared_link", [False, True])
def test_the_floor_is_the_steps_whatever_the_budget(shared_link: bool) -> None:
    # Issue 34, item 4: one meaning for "floor". The same profile planned for
    # budgets from nothing to everything reports one floor, and a budget's
    # plan that stops above its budget says so apart from the floor.
    profile = dataclasses.replace(_chain(8), shared_link=shared_link)
    everything = simulate(profile, ("keep",) * 8, profile.window_bytes).peak_bytes
    floor = floor_bytes(profile)
    floors = {
        make_plan(profile, int(everything * f)).floor_bytes for f in (0, 0.2, 0.4, 0.7, 1.0, 2.0)
    }
    assert floors == {floor}
    assert 0 < floor < everything
    below = make_plan(profile, floor // 2)
    assert not below.fits
    assert f"budget {_size(floor // 2)} (not met: this plan's peak is" in str(below)
    assert "not met" not in str(make_plan(profile, everything))


# NOTE [ The H200 step ]
# Issue 33's step: the same GPT on one H200, 68 ms without offload; each
# block saves about 0.53 GiB in about 1.6 ms of forward, backward takes about
# twice forward, PCIe moves 55 GB/s each way. BASE is calibrated as the H100's
# is: checkpointing every block at 0.37x of no offload's memory, as measured.
H200_UNIT = int(0.53 * GIB / 16)
H200_STEP_S = 68e-3


def _h200() -> tuple[Profile, int, int]:
    """The H200 step's profile, BASE and no offload's memory."""
    profile = _h100_profile(H200_UNIT, 1.6e-3, H200_STEP_S, 55e9)
    every = simulate(profile, _checkpoint_first(profile, BLOCKS), profile.window_bytes)
    saved = sum(s.nbytes for s in profile.saves)
    base = int((every.peak_bytes - 0.37 * saved) / (1 - 0.37))
    return profile, base, base + saved


@pytest.mark.parametrize(
    ("memory", "target", "checkpointed"),
    [(0.84, 1.02, 1.07), (0.68, 1.05, 1.12), (0.52, 1.10, 1.16), (0.37, 1.15, 1.21)],
)
def test_h200_beats_checkpointing_at_every_memory_level(
    memory: float, target: float, checkpointed: float
) -> None:
    # Issue 33's targets, each below checkpointing the first N blocks at that
    # memory as measured on the H200 (``checkpointed``).
    profile, base, none_bytes = _h200()
    plan = make_plan(profile, int(memory * none_bytes - base))
    assert plan.fits
    assert plan.predicted_step_s / H200_STEP_S <= target < checkpointed


@pytest.mark.parametrize("memory", [0.84, 0.68, 0.52, 0.37])
def test_h200_offloads_only_what_the_link_hides(memory: float) -> None:
    # The bytes offloaded from each block on are bounded by the link times
    # the forward compute left after the block starts, plus the window that
    # forward may leave going (it lands early in backward, counted resident).
    # Neither the last block nor a later block offloading more than an
    # earlier one is ruled out: the simulation finds them hidden (the last
    # block's input, one activation of 35 MB, goes out behind 2.4 ms of
    # forward, 130 MB of link), and keeping them would cost the budget room.
    profile, base, none_bytes = _h200()
    plan = make_plan(profile, int(memory * none_bytes - base))
    by_block = [0] * BLOCKS
    for save, choice in zip(profile.saves, plan.choices, strict=True):
        if choice == "offload" and save.module.startswith("blocks."):
            by_block[int(save.module.split(".")[1])] += save.nbytes
    rate, window = profile.write_bytes_per_s, profile.window_bytes
    assert sum(by_block) <= rate * profile.forward_s + window
    for b in range(BLOCKS):
        after = profile.forward_s - profile.saves[8 * b].forward_s  # forward left after the block
        assert sum(by_block[b:]) <= rate * after + window


#: A real H200 run of the step above: each budget row holds its plan's whole
#: profile and choices, and the steps it ran (benchmarks/gpu_step.py).
H200_RUN = (
    Path(__file__).resolve().parents[2] / "benchmarks/results/2026-11-27-h200-gpu-step-a9608e4.json"
)


def _profile_of(fields: dict[str, object]) -> Profile:
    """A Profile from its JSON (dataclasses.asdict's lists back to tuples)."""
    saves = tuple(
        Save(**{**s, "inputs": tuple(s["inputs"]), "made_in": tuple(s["made_in"])})
        for s in fields["saves"]  # type: ignore[attr-defined]
    )
    rest = {k: v for k, v in fields.items() if k != "saves"}
    rest["stays_in"] = tuple(tuple(x) for x in rest["stays_in"])  # type: ignore[attr-defined]
    rest["stored_in"] = tuple(rest["stored_in"])  # type: ignore[arg-type]
    return Profile(saves=saves, **rest)  # type: ignore[arg-type]


@pytest.mark.parametrize("row", ["budget=0.68", "budget=0.52", "budget=0.37"])
def test_a_real_h200_plan_predicts_the_steps_it_ran(row: str) -> None:
    # The planner's prediction, on the profile a real step gave it, against
    # the steps that plan then ran on the H200, its first left out (it runs
    # the kernels' first launches): within 5%. budget=0.84's plan ran at its
    # prediction for five steps and then 10% over it (docs/benchmarks.md).
    run = json.loads(H200_RUN.read_text())
    (r,) = [x for x in run["rows"] if x["row"] == row]
    profile = _profile_of(r["plan"]["profile_all"])
    predicted = simulate(profile, tuple(r["plan"]["choices"]), profile.window_bytes).step_s
    ran = [s for s, p in zip(r["steps_s"], r["plan_history"], strict=True) if p and p[0] >= 1]
    assert len(ran) >= 12
    assert predicted == pytest.approx(statistics.median(ran), rel=0.05)


#: A later H200 run, with rebuilds from the autograd graph (NOTE [ Rebuilt
#: from the graph ] in tierstore/autograd/recompute.py).
H200_GRAPH_RUN = H200_RUN.with_name("2026-11-27-h200-gpu-step-2ac90c7.json")


def test_a_real_h200_plan_that_rebuilds_from_the_graph_predicts_the_steps_it_ran() -> None:
    # budget=0.84's last plan rebuilds 9 GELU outputs from the graph, records
    # nothing and moves nothing: its prediction held within 2% of the steps
    # it ran, its first left out, as budget=0.52's (native and graph) did.
    run = json.loads(H200_GRAPH_RUN.read_text())
    for row, graph, rel in (("budget=0.84", 9, 0.02), ("budget=0.52", 7, 0.05)):
        (r,) = [x for x in run["rows"] if x["row"] == row]
        profile = _profile_of(r["plan"]["profile_all"])
        choices = tuple(r["plan"]["choices"])
        assert len(from_graph(profile, choices)) == graph
        assert recorded_rebuilds(profile, choices) == 0
        predicted = simulate(profile, choices, profile.window_bytes).step_s
        ran = [
            s
            for s, p in zip(r["steps_s"], r["plan_history"], strict=True)
            if p and p[0] >= 1 and p[1] == r["plan"]["predicted_step_s"]
        ]
        assert len(ran) >= 4
        assert predicted == pytest.approx(statistics.median(ran), rel=rel)


@pytest.mark.parametrize(
    ("memory", "before", "blocks"), [(0.68, 1.080, ["GPT.blocks.0"]), (0.52, 1.146, None)]
)
def test_fewer_blocks_are_checkpointed_where_the_graph_rebuilds_the_rest(
    memory: float, before: float, blocks: list[str] | None
) -> None:
    # The H200 GPT step as its plan profiled it, GELU's outputs rebuildable
    # from the graph: at 0.68x of no offload's memory, counted without those
    # rebuilds the first five blocks had to be checkpointed for the peak to
    # fit, and the search started from three to five blocks: 1.080x. Counted
    # with them, three, and the search from one block on offloads six saves
    # and rebuilds eleven GELU outputs beside it: 1.060x (_checkpointed).
    run = json.loads(H200_GRAPH_RUN.read_text())
    rows = {x["row"]: x for x in run["rows"]}
    profile = _profile_of(rows["budget=0.84"]["plan"]["profile_all"])
    none = rows["none"]["peak_allocated_bytes"]
    plan = make_plan(profile, int(memory * none - (none - profile.saved_bytes)))
    keep = simulate(profile, ("keep",) * len(profile.saves), profile.window_bytes).step_s
    assert plan.fits
    assert plan.predicted_step_s / keep < before - 0.005
    if blocks is not None:
        assert [name for name, _, _ in replayed(profile, plan.choices)] == blocks
        assert len(from_graph(profile, plan.choices)) == 11
        assert offloaded_saves(profile, plan.choices) == 6


def test_checkpointing_counts_only_the_graphs_rebuilds_it_can_take() -> None:
    # The same profile with LayerNorm's and the first Linear's outputs
    # rebuildable from the graph too (views a Linear saves whose rebuild
    # reads the residual stream alone; the 4d-wide views before GELU, whose
    # outputs then chain on them): counting every such save freed, GELU's
    # outputs included, the fewest blocks that fit were too few to start
    # from, and at 0.52x the plan predicted 1.216x. Counting only those
    # from_graph() would take, no worse than the profile without them.
    run = json.loads(H200_GRAPH_RUN.read_text())
    rows = {x["row"]: x for x in run["rows"]}
    profile = _profile_of(rows["budget=0.84"]["plan"]["profile_all"])
    saves = list(profile.saves)
    for i, save in enumerate(saves):
        norm = len(save.inputs) == 1 and saves[save.inputs[0]].op == "aten.add"
        linear = save.nbytes == 128 * MIB and not save.graph
        if save.op == "aten.view" and save.rebuild_s is not None and (norm or linear):
            saves[i] = dataclasses.replace(save, graph=True)
    marked = dataclasses.replace(profile, saves=tuple(saves))
    assert len(marked.graph_saves) == 12 + 25 + 12
    none = rows["none"]["peak_allocated_bytes"]
    budget = int(0.52 * none - (none - profile.saved_bytes))
    keep = simulate(profile, ("keep",) * len(profile.saves), profile.window_bytes).step_s
    plan = make_plan(marked, budget)
    assert plan.fits
    assert plan.predicted_step_s / keep < 1.11
    assert plan.predicted_step_s <= make_plan(profile, budget).predicted_step_s


def _blocks(n: int, per: int, *, recorded: float, link: float = 1e3) -> Profile:
    """``n`` blocks of ``per`` saves (an input, then cheap ops), a slow link, 1 ms per op."""
    saves = tuple(
        Save(1000, "aten.gelu", f"m.{b}", 0.001 * (b * per + k), 0.001 * ((n - b) * per - k), 0.001)
        for b in range(n)
        for k in range(per)
    )
    return Profile(saves, 0.001 * n * per, 0.002 * n * per, 0.0, link, link, 1000,
                   recorded_rebuild_s=recorded)  # fmt: skip


def test_a_rebuild_from_the_graph_costs_its_compute_alone_and_never_from_a_rebuilt_input() -> None:
    # NOTE [ Rebuilt from the graph ] in autograd/graph.py: no recorder runs for
    # it, so no recorder's charge; its inputs kept or stored (the node holds
    # them as the hook packed them), never rebuilt themselves.
    p = _blocks(2, 3, recorded=0.5)
    graph = dataclasses.replace(p.saves[2], inputs=(1,), graph=True)
    q = dataclasses.replace(p, saves=(*p.saves[:2], graph, *p.saves[3:]))
    kept_input = ("keep", "keep", "rebuild") + ("keep",) * 3
    assert from_graph(q, kept_input) == {2} and recorded_rebuilds(q, kept_input) == 0
    assert simulate(q, kept_input, q.window_bytes).step_s == pytest.approx(
        simulate(p, ("keep",) * 6, p.window_bytes).step_s + 0.001
    )
    # Its input stored: read back for the rebuild, still no recorder.
    stored_input = ("keep", "offload", "rebuild") + ("keep",) * 3
    assert from_graph(q, stored_input) == {2} and recorded_rebuilds(q, stored_input) == 0
    recorded = dataclasses.replace(
        q, saves=(*q.saves[:2], dataclasses.replace(graph, graph=False), *q.saves[3:])
    )
    assert recorded_rebuilds(recorded, stored_input) == 1
    assert simulate(q, stored_input, q.window_bytes).step_s == pytest.approx(
        simulate(recorded, stored_input, q.window_bytes).step_s - 0.5  # the recorder's charge
    )
    # Its input rebuilt itself: not from the graph (from_graph's example).
    assert from_graph(q, ("keep", "rebuild", "rebuild") + ("keep",) * 3) == set()
    # And it does not stop the recorder-free checkpointing of another module.
    both = (*kept_input[:3], "keep", "rebuild", "rebuild")
    assert replayed(q, both) == (("m.1", 3, 6),) and recorded_rebuilds(q, both) == 0


def test_a_module_that_holds_an_input_of_a_rebuild_from_the_graph_is_not_kept_whole() -> None:
    # NOTE [ Modules kept whole ]: inside one, autograd holds the saves, not
    # the pack hook, and a rebuild from the graph reads its input as packed.
    p = _blocks(2, 3, recorded=0.0)
    everything = ("keep",) * 6
    assert [m for m, _, _ in kept_whole(p, everything)] == ["m.0", "m.1"]
    graph = dataclasses.replace(p.saves[3], inputs=(2,), graph=True)
    q = dataclasses.replace(p, saves=(*p.saves[:3], graph, *p.saves[4:]))
    rebuilt = ("keep",) * 3 + ("rebuild", "keep", "keep")
    assert from_graph(q, rebuilt) == {3}
    assert kept_whole(q, rebuilt) == ()  # m.0 holds its input; m.1 rebuilds
    assert [m for m, _, _ in kept_whole(q, everything)] == ["m.0", "m.1"]


def test_replayed_modules_are_those_rebuilt_whole_from_a_kept_input() -> None:
    # NOTE [ Replayed modules ]: a module whose saves follow one another, its
    # first kept and the rest rebuilt, and no other rebuild recording in it.
    p = _blocks(3, 3, recorded=0.0)
    whole = ("keep", "rebuild", "rebuild")
    assert replayed(p, whole * 3) == (("m.0", 0, 3), ("m.1", 3, 6), ("m.2", 6, 9))
    assert replayed(p, ("keep", "keep", "rebuild") + whole * 2) == (("m.1", 3, 6), ("m.2", 6, 9))
    assert replayed(p, ("offload", "rebuild", "rebuild") + ("keep",) * 6) == ()
    # A rebuild of m.2 that replays ops m.1 ran records in m.1: it is not checkpointed.
    made_in_m1 = dataclasses.replace(p.saves[8], made_in=("m.1",))
    q = dataclasses.replace(p, saves=(*p.saves[:8], made_in_m1))
    assert replayed(q, whole + whole + ("keep", "keep", "rebuild")) == (("m.0", 0, 3),)
    assert recorded_rebuilds(q, whole + whole + ("keep", "keep", "rebuild")) == 3
    # Nor a module that ran compiled: checkpoint would replay it eagerly.
    ran_compiled = dataclasses.replace(p.saves[1], compiled=True)
    r = dataclasses.replace(p, saves=(p.saves[0], ran_compiled, *p.saves[2:]))
    assert replayed(r, whole * 3) == (("m.1", 3, 6), ("m.2", 6, 9))
    # Saves of a module that come apart (its output saved after another's) never replay.
    apart = dataclasses.replace(p, saves=(*p.saves[:2], p.saves[3], p.saves[2], *p.saves[4:]))
    assert [m for m, _, _ in apart.spans] == ["m.2"]


def test_op_by_op_rebuilds_pay_what_a_planned_step_measured_and_checkpointing_does_not() -> None:
    p = _blocks(4, 4, recorded=0.01)
    whole = ("keep", "rebuild", "rebuild", "rebuild")
    split = ("keep", "rebuild", "rebuild", "keep")
    keep = ("keep",) * 4
    base = simulate(p, keep * 4, p.window_bytes).step_s
    assert simulate(p, whole + keep * 3, p.window_bytes).step_s == pytest.approx(base + 0.003)
    assert simulate(p, split + keep * 3, p.window_bytes).step_s == pytest.approx(
        base + 2 * (0.001 + 0.01)
    )
    # The search: a budget a checkpointed block meets; the op-by-op plans would
    # rebuild as many bytes and pay the recorder on each.
    budget = p.saved_bytes - 3000
    plan = make_plan(p, budget)
    assert plan.fits
    assert [m for m, _, _ in replayed(p, plan.choices)] == ["m.0"]
    assert recorded_rebuilds(p, plan.choices) == 0
    assert plan.predicted_step_s == pytest.approx(base + 0.003)


def test_a_plan_that_hands_the_heap_back_pays_for_it() -> None:
    # NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py: a CPU step hands it
    # back unless its plan moves nothing and rebuilds only natively.
    p = dataclasses.replace(_blocks(3, 3, recorded=0.0), hand_back_s=0.5)
    free = dataclasses.replace(p, hand_back_s=0.0)
    whole, keep = ("keep", "rebuild", "rebuild"), ("keep",) * 3
    cases = {
        keep * 3: False,
        whole + keep * 2: False,  # m.0 checkpointed
        whole * 3: False,
        ("keep", "keep", "rebuild") + keep * 2: True,  # op by op
        ("keep", "offload", "keep") + keep * 2: True,
        ("keep", "offload", "keep") + whole * 2: True,
    }
    for choices, hands_back in cases.items():
        assert hands_heap_back(p, choices) is hands_back, choices
        paid = simulate(p, choices, p.window_bytes).step_s
        assert paid == pytest.approx(
            simulate(free, choices, p.window_bytes).step_s + (0.5 if hands_back else 0.0)
        )
        assert not hands_heap_back(free, choices)  # a GPU's, or a C library without malloc_trim


def test_on_a_cpu_a_plan_checkpoints_rather_than_hand_the_heap_back() -> None:
    # Issue 34, item 3: on a CPU, where checkpointing a block meets the budget,
    # a plan that hides its copies on a fast link would still pay the faults
    # of its hand-backs, which checkpointing does not.
    p = _blocks(4, 4, recorded=0.0, link=1e9)
    budget = p.saved_bytes - 3000
    moving = make_plan(p, budget)
    assert moving.fits and moving.bytes_by_choice()["offload"] > 0  # nothing to pay: copies
    assert moving.hands_back is False  # hand_back_s is 0: nothing is
    cpu = dataclasses.replace(p, hand_back_s=0.01)  # dearer than m.0's rebuilds
    plan = make_plan(cpu, budget)
    assert plan.fits and not plan.hands_back
    assert plan.bytes_by_choice()["offload"] == 0
    assert [m for m, _, _ in replayed(cpu, plan.choices)] == ["m.0"]
    cheap = dataclasses.replace(p, hand_back_s=0.001)  # cheaper than them: the copies again
    assert make_plan(cheap, budget).hands_back


def _dropout_blocks() -> Profile:
    """Two modules of three saves, the last a random op's (dropout's mask): ``rebuild_s`` None."""
    sizes = (2000, 1000, 4000, 4000, 2000, 4000)
    rebuild = (0.01, 0.01, None, 0.003, 0.01, None)
    inputs: tuple[tuple[int, ...], ...] = ((), (0,), (), (), (3,), ())
    saves = tuple(
        Save(nbytes, "aten.x", f"m.{i // 3}", 0.01 * i, 0.01 * (5 - i), cost, ins)
        for i, (nbytes, cost, ins) in enumerate(zip(sizes, rebuild, inputs, strict=True))
    )
    return Profile(saves, 0.06, 0.06, 0.0, 1e5, 1e6, 4000)


def test_a_random_save_is_rebuilt_only_where_its_module_is_checkpointed() -> None:
    # NOTE [ Replayed modules ]: checkpoint replays a module's RNG state; op by
    # op the store cannot rebuild a random op's save and offloads it, outside
    # the plan's window and peak. A plan that does so cannot run as planned.
    p = _dropout_blocks()
    whole = ("keep", "rebuild", "rebuild")
    assert math.isfinite(simulate(p, whole * 2, p.window_bytes).step_s)
    for broken in (("offload", "rebuild", "rebuild"), ("keep", "keep", "rebuild")):
        assert simulate(p, broken + whole, p.window_bytes).step_s == math.inf
    # The search from the checkpointed start took a block's input or one of
    # its rebuilds back and left its mask "rebuilt" for nothing.
    for fraction in (0.3, 0.4, 0.5, 0.6):
        plan = make_plan(p, int(fraction * p.saved_bytes))
        native = {j for _, first, end in replayed(p, plan.choices) for j in range(first + 1, end)}
        unrebuildable = [i for i, s in enumerate(p.saves) if s.rebuild_s is None]
        assert all(plan.choices[i] != "rebuild" or i in native for i in unrebuildable), (
            fraction,
            plan.choices,
        )
        assert math.isfinite(plan.predicted_step_s)


def test_a_tensor_saved_twice_takes_its_first_saves_choice() -> None:
    # NOTE [ A tensor saved twice ]: log_softmax's output saved again by
    # nll_loss. Chosen on its own, the second save (no bytes) stayed offloaded
    # beside a first save the plan kept, and went off the device in full.
    early = tuple(Save(1000, "aten.mm", f"m{i}", 0.1 * i, 1.5 - 0.1 * i, 0.01) for i in range(4))
    first = Save(4000, "aten._log_softmax", "top", 0.45, 0.0, 0.01)
    again = Save(0, "aten._log_softmax", "top", 0.45, 0.0, 0.01, same_as=4)
    profile = Profile((*early, first, again), 0.5, 2.0, 0.0, 1e3, 1e3, 2000)
    for budget in (3000, 4000, 5000, 6000):
        plan = make_plan(profile, budget)
        assert plan.choices[5] == plan.choices[4]
        assert plan.predicted_step_s == simulate(profile, plan.choices, plan.window_bytes).step_s
    assert make_plan(profile, 4000).choices[4:] == ("keep", "keep")
    assert tied(profile, ("keep",) * 5 + ("offload",))[5] == "keep"


def test_each_moved_save_pays_its_host_time_once() -> None:
    # NOTE [ Charging a slow step ] in planning/checker.py: on CUDA what a moved save
    # costs is the host's, per save; a tensor saved again moves with its first.
    saves = (
        Save(1000, "aten.mm", "a", 0.1, 1.0),
        Save(10, "aten.mm", "b", 0.2, 0.5),
        Save(0, "aten.mm", "b", 0.2, 0.5, same_as=1),
    )
    profile = Profile(saves, 0.3, 1.5, 0.0, 1e9, 1e9, 4096)
    priced = dataclasses.replace(profile, moved_s_per_save=0.25)
    for choices in [("offload", "keep", "keep"), ("offload", "offload", "offload")]:
        moved = sum(c == "offload" and s.nbytes > 0 for c, s in zip(choices, saves, strict=True))
        base = simulate(profile, choices, 4096).step_s
        assert simulate(priced, choices, 4096).step_s == pytest.approx(base + 0.25 * moved)


def test_a_tensor_saved_twice_across_replayed_modules_leaves_them_replayed() -> None:
    # NOTE [ A tensor saved twice ]: blocks of Linear then Tanh, each block's
    # input the last block's Tanh output. Checkpoint takes the saves of a
    # block replayed natively; tying the next block's input to a rebuild
    # would have unmade that block's replay.
    saves = []
    for b in range(3):
        same = {"same_as": 2 * b - 1} if b else {}
        saves.append(Save(0 if b else 100, "aten.tanh", f"m.{b}", 0.1 * b, 1.0, 0.01, **same))
        saves.append(Save(100, "aten.tanh", f"m.{b}", 0.1 * b + 0.05, 0.9, 0.01))
    profile = Profile(tuple(saves), 0.3, 1.0, 0.0, 1e9, 1e9, 1000)
    choices = ("keep", "keep", "keep", "rebuild", "keep", "rebuild")
    assert replayed(profile, choices) == (("m.1", 2, 4), ("m.2", 4, 6))
    assert tied(profile, choices) == choices
    # Where no module is replayed, the second save follows the first.
    assert tied(profile, ("keep", "offload", "keep", "offload", "keep", "keep")) == (
        "keep", "offload", "offload", "offload", "offload", "keep",
    )  # fmt: skip
