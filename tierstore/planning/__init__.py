"""Planning: from a profiled step and a budget to a plan, and the plan carried out.

:mod:`~tierstore.planning.planner` is a pure function over numbers (a
:class:`~tierstore.planning.planner.Profile` and a budget in, a
:class:`~tierstore.planning.planner.Plan` out); it imports neither torch nor
the rest of the package, so the planning process
(:mod:`~tierstore.planning.worker`, started by
:mod:`~tierstore.planning.process`) starts cheaply. The runner
(:mod:`~tierstore.planning.runner`) says for each save what the plan chose,
and tells the tier manager its limits (:mod:`~tierstore.planning.limits`);
the recorder (:mod:`~tierstore.planning.recorder`) makes a profiled step,
timed by :mod:`~tierstore.planning.timers`, into a profile; the checker
(:mod:`~tierstore.planning.checker`) has it planned off the training thread
and checks each prediction against the measurement. This layer knows
nothing of how bytes rest or move.

Example:
    >>> from tierstore.planning.planner import Profile, Save, make_plan
    >>> saves = tuple(Save(1 << 20, "aten.mm", f"block.{i}", 0.01, 0.01, 0.01) for i in range(2))
    >>> profile = Profile(saves, 0.02, 0.04, 0.0, 10e9, 10e9, 64 << 20)
    >>> make_plan(profile, 4 << 20).choices   # room for both: nothing moves
    ('keep', 'keep')
"""
