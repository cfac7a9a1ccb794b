"""The HCache restore planner on hand-computed cases (the expected plans are derived in the comments
from the two-stream model, not by calling the planner's own estimate), and confirm_plan's choice by
measurement."""

from __future__ import annotations

from jhybrid.hcache.planner import LayerCosts, RestorePlan, confirm_plan, estimate_seconds, plan_restore


def test_estimate_of_small_plans_by_hand():
    c = LayerCosts(num_tokens=1, io_hidden=2.0, project=1.0, io_kv=3.0, recompute=5.0)
    # hidden, hidden: io 2 -> compute 3, io 4 -> compute max(3, 4) + 1 = 5; io done 4 -> 5
    assert estimate_seconds(("hidden", "hidden"), c) == 5.0
    # recompute, kv: compute 5; io 3 -> 5
    assert estimate_seconds(("recompute", "kv"), c) == 5.0
    # recompute, hidden, kv: compute 5; io 2, hidden's projection at max(5, 2) + 1 = 6; io 2 + 3 = 5 -> 6
    assert estimate_seconds(("recompute", "hidden", "kv"), c) == 6.0


def test_planner_mixes_when_io_and_compute_balance():
    # 4 layers; kv reads cost 4, recompute 4, hidden 1 + projection 1.
    # all hidden: io 1, 2, 3, 4; compute 2, 3, 4, 5 -> 5. all kv: 16; all recompute: 16.
    # 3 hidden + 1 kv: io 1, 2, 3 then kv 4 -> io 7; compute 4 -> 7. Worse than all hidden.
    c = LayerCosts(num_tokens=1, io_hidden=1.0, project=1.0, io_kv=4.0, recompute=4.0)
    plan = plan_restore(c, 4)
    assert plan.methods == ("hidden",) * 4 and plan.estimated_seconds == 5.0
    assert plan.single_method_seconds == {"hidden": 5.0, "kv": 16.0, "recompute": 16.0}
    # Slow storage (io_hidden 3, io_kv 6) and cheap recompute (2). By hand: all recompute 8, all
    # hidden 13 (io 3, 6, 9, 12 -> last projection 13), 2 recompute + 2 hidden 7 (compute 4; io 3, 6;
    # projections 5, 7), 3 recompute + 1 hidden 7 (compute 6, then 7), 3 recompute + 1 kv: compute 6
    # and io 6 in parallel -> 6, the best.
    c = LayerCosts(num_tokens=1, io_hidden=3.0, project=1.0, io_kv=6.0, recompute=2.0)
    plan = plan_restore(c, 4)
    assert plan.methods == ("recompute", "recompute", "recompute", "kv") and plan.estimated_seconds == 6.0


def test_confirm_plan_keeps_what_measures_fastest():
    plan = RestorePlan(methods=("kv", "kv"), estimated_seconds=1.0,
                       single_method_seconds={"hidden": 2.0, "kv": 1.0, "recompute": 9.0})
    measured = {("kv", "kv"): 3.0, ("hidden", "hidden"): 1.5, ("recompute", "recompute"): 5.0}
    chosen = confirm_plan(plan, lambda methods: measured[methods], repeats=1)
    assert chosen.methods == ("hidden", "hidden")  # the estimate ranked kv first; the machine did not
    skipped = confirm_plan(plan, lambda methods: measured[methods], repeats=1, skip_estimated_slower=3.0)
    assert skipped.methods == ("hidden", "hidden")  # recompute (9x the estimate) not even measured
