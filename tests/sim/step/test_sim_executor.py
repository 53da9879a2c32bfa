"""The step executors on hand-built programs: barriers, overlap, interference, host launches; and the fast
executor against the simpy one."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.sim.step.executor.exact import run_exact
from epsim.sim.step.executor.program import (
    CATEGORIES,
    Program,
    build_chains,
    collective_waits,
    plan_steps,
    run_fast,
)

C = {c: i for i, c in enumerate(CATEGORIES)}


def program(ops, ranks, *, slowdown=0.0, launch_s=0.0, node_s=0.0, floor=0.0, sync=(),
            release=None, slots=1, fold=True):
    """ops: (name, kind "c"/"x" (compute/collective), category, deps by name, work per rank).
    sync: collectives the eager host waits on, ``release`` seconds after they start (default:
    their whole duration)."""
    names = [o[0] for o in ops]
    work = np.array([np.broadcast_to(np.asarray(o[4], dtype=float), (ranks,)) for o in ops])
    prog = Program(
        op_ids=tuple(names), kinds=tuple("dispatch" if o[1] == "x" else "gemm" for o in ops),
        categories=np.array([C[o[2]] for o in ops]), layers=tuple(0 for _ in ops),
        microbatches=tuple(0 for _ in ops), is_coll=np.array([o[1] == "x" for o in ops]),
        deps=tuple(tuple(names.index(d) for d in o[3]) for o in ops), work=work + node_s,
        node_s=node_s, floor=np.full(len(ops), floor), launch_s=launch_s,
        host_sync=np.array([o[0] in sync for o in ops]),
        host_release_s=np.array([(float(np.max(o[4])) if release is None else release)
                                 if o[0] in sync else 0.0 for o in ops]),
        group_size=np.array([ranks if o[1] == "x" else 0 for o in ops]), slowdown=slowdown,
        comm_slots=slots,
    )
    if fold and launch_s == 0:
        from dataclasses import replace
        prog = replace(prog, steps=plan_steps(prog, fold=True))
    return prog


def both(prog):
    fast, exact, unfolded = run_fast(prog), run_exact(prog), run_fast(prog, fold=False)
    np.testing.assert_allclose(fast.rank_end, exact.rank_end, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(unfolded.rank_end, exact.rank_end, rtol=1e-9, atol=1e-12)
    # op by op, the breakdown is the same; a folded run shares its interference stretch among its
    # categories in proportion to their own time, so only the totals must match there
    np.testing.assert_allclose(unfolded.breakdown, exact.breakdown, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(unfolded.start, exact.start, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fast.breakdown.sum(axis=1), exact.breakdown.sum(axis=1),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fast.slowdown_s, exact.slowdown_s, rtol=1e-9, atol=1e-12)
    return exact


def test_a_dispatch_reading_the_norm_and_the_router_waits_on_the_router_only():
    # norm -> router -> dispatch, and the dispatch reads the norm's rows too (as the graph says)
    ops = [
        ("norm", "c", "moe_experts", (), 1.0),
        ("router", "c", "moe_experts", ("norm",), 0.5),
        ("x", "x", "dispatch", ("router", "norm"), 2.0),
        ("experts", "c", "moe_experts", ("x",), 1.0),
    ]
    prog = program(ops, ranks=2)
    assert collective_waits(2, prog.is_coll, prog.deps) == (1,)
    # the norm needs no end time of its own: it folds into one run with the router
    assert build_chains(prog.is_coll, prog.deps, fold=True) == ((0, 1), (2,), (3,))
    tl = both(prog)
    np.testing.assert_allclose(tl.start[2], [1.5, 1.5])
    np.testing.assert_allclose(tl.rank_end, [4.5, 4.5])
    # a compute dependency no other dependency reads still ends its run
    ops[2] = ("x", "x", "dispatch", ("norm",), 2.0)
    prog = program(ops, ranks=2)
    assert build_chains(prog.is_coll, prog.deps, fold=True) == ((0,), (1,), (2,), (3,))
    np.testing.assert_allclose(both(prog).start[2], [1.0, 1.0])


def test_collective_waits_for_its_slowest_rank():
    prog = program([
        ("a", "c", "attention", (), [1.0, 3.0]),
        ("x", "x", "dispatch", ("a",), 2.0),
        ("b", "c", "moe_experts", ("x",), 1.0),
    ], ranks=2)
    tl = both(prog)
    np.testing.assert_allclose(tl.start[1], [3.0, 3.0])
    np.testing.assert_allclose(tl.end[1], [5.0, 5.0])
    np.testing.assert_allclose(tl.rank_end, [6.0, 6.0])
    # rank 0 waited 4 s for the dispatch (2 for rank 1 to arrive, 2 of transfer)
    assert tl.breakdown[0, C["dispatch"]] == pytest.approx(4.0)
    assert tl.breakdown[1, C["dispatch"]] == pytest.approx(2.0)
    assert tl.breakdown.sum(axis=1) == pytest.approx(tl.rank_end)


def test_overlapped_all_to_all_adds_only_its_exposed_part():
    # DBO-like: mb0's dispatch (5 s) runs while mb1 computes (3 s): 2 s stay exposed
    ops = [
        ("a0", "c", "attention", (), 1.0),
        ("x0", "x", "dispatch", ("a0",), 5.0),
        ("a1", "c", "attention", (), 3.0),
        ("e0", "c", "moe_experts", ("x0",), 1.0),
    ]
    tl = both(program(ops, ranks=4))
    assert tl.rank_end == pytest.approx([7.0] * 4)  # 1 + 5 + 1, not 1 + 5 + 3 + 1
    assert tl.breakdown[0, C["dispatch"]] == pytest.approx(2.0)
    assert tl.comm_busy[0, C["dispatch"]] == pytest.approx(5.0)
    # serialised (no overlap partner), the whole 5 s is exposed
    serial = both(program([ops[0], ops[1], ops[3]], ranks=4))
    assert serial.breakdown[0, C["dispatch"]] == pytest.approx(5.0)


def test_comm_slows_overlapping_compute_by_the_profile_share():
    # a 2 s compute op entirely inside a 10 s collective at half speed takes 4 s
    ops = [
        ("x", "x", "combine", (), 10.0),
        ("a", "c", "attention", (), 2.0),
    ]
    tl = both(program(ops, ranks=2, slowdown=0.5))
    np.testing.assert_allclose(tl.end[1], [4.0, 4.0])
    np.testing.assert_allclose(tl.slowdown_s, [2.0, 2.0])
    # half inside: 1 s of work done at half speed in the last 2 s of a 2 s collective
    ops = [("x", "x", "combine", (), 2.0), ("a", "c", "attention", (), 2.0)]
    tl = both(program(ops, ranks=2, slowdown=0.5))
    np.testing.assert_allclose(tl.end[1], [3.0, 3.0])


def test_eager_host_launch_and_dispatch_sync():
    # 4 tiny kernels at 1 s of host launch each: the GPU waits for the host
    ops = [(f"k{i}", "c", "dense", (), 0.1) for i in range(4)]
    tl = both(program(ops, ranks=1, launch_s=1.0))
    assert tl.rank_end[0] == pytest.approx(4.1)
    assert tl.breakdown[0, C["launch"]] == pytest.approx(4.0 - 0.3)
    # after a dispatch the host waits for it before launching anything else
    ops = [("a", "c", "dense", (), 0.1), ("x", "x", "dispatch", ("a",), 5.0),
           ("b", "c", "dense", (), 0.1)]
    tl = both(program(ops, ranks=2, launch_s=1.0, sync=("x",)))
    # a: launched at 1, ends 1.1; x: launched at 2, runs 2..7; b: launched at 7 + 1
    assert tl.rank_end == pytest.approx([8.1, 8.1])
    # b's stream sat idle 1.1..8: 5.9 s while the host waited on the dispatch, 1 s launching
    assert tl.breakdown[0, C["dispatch"]] == pytest.approx(5.9)
    assert tl.breakdown[0, C["launch"]] == pytest.approx(1.0 + 1.0)  # + a's own launch wait
    # a host released by the dispatch's count exchange (0.5 s after it starts) launches b while
    # the payload is still moving: b runs 3.5..3.6, the step ends with the dispatch at 7
    tl = both(program(ops, ranks=2, launch_s=1.0, sync=("x",), release=0.5))
    assert tl.start[2] == pytest.approx([3.5, 3.5])
    assert tl.rank_end == pytest.approx([7.0, 7.0])


def test_graph_node_cost_is_charged_to_launch():
    ops = [(f"k{i}", "c", "dense", (), 1.0) for i in range(3)]
    tl = both(program(ops, ranks=1, node_s=0.25, floor=0.5))
    assert tl.rank_end[0] == pytest.approx(0.5 + 3 * 1.25)
    assert tl.breakdown[0, C["launch"]] == pytest.approx(0.5 + 3 * 0.25)
    assert tl.breakdown[0, C["dense"]] == pytest.approx(3.0)


@st.composite
def random_programs(draw):
    ranks = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(3, 14))
    ops = []
    for i in range(n):
        coll = i > 0 and draw(st.booleans())
        if coll:
            # a collective reads the op just before it, as the graph builder makes them
            prev = ops[-1][0]
            deps = (prev,) if ops[-1][1] == "c" else ()
            ops.append((f"o{i}", "x", draw(st.sampled_from(["dispatch", "combine"])), deps,
                        draw(st.floats(0.1, 3.0))))
        else:
            colls = [o[0] for o in ops if o[1] == "x"]
            deps = tuple(draw(st.lists(st.sampled_from(colls), max_size=2, unique=True))) \
                if colls else ()
            works = draw(st.lists(st.floats(0.1, 3.0), min_size=ranks, max_size=ranks))
            ops.append((f"o{i}", "c", draw(st.sampled_from(["attention", "moe_experts"])),
                        deps, works))
    slowdown = draw(st.sampled_from([0.0, 0.2, 0.5]))
    launch = draw(st.sampled_from([0.0, 0.3]))
    return program(ops, ranks, slowdown=slowdown, launch_s=launch,
                   sync=("o1", "o3") if launch else (),
                   release=draw(st.sampled_from([None, 0.05])),
                   slots=draw(st.sampled_from([1, 2])))


@settings(max_examples=60, deadline=None)
@given(random_programs())
def test_fast_executor_matches_simpy(prog):
    both(prog)


def test_two_comm_slots_run_collectives_side_by_side():
    # two independent 1 s collectives and a 2 s compute op on one rank, compute slowed by half
    # while anything is in flight
    ops = [("x1", "x", "dispatch", (), 1.0), ("x2", "x", "combine", (), 1.0),
           ("c", "c", "dense", (), 2.0)]
    one = both(program(ops, ranks=1, slowdown=0.5, slots=1))
    two = both(program(ops, ranks=1, slowdown=0.5, slots=2))
    # one slot: x2 waits for x1 (0..1, 1..2); compute at half speed for 2 s does 1 s of work,
    # then 1 s at full speed: ends at 3
    assert one.rank_end[0] == pytest.approx(3.0)
    # two slots: both in flight 0..1; compute does 0.5 s of work there, 1.5 s after: ends at 2.5
    assert two.start[1, 0] == pytest.approx(0.0)
    assert two.rank_end[0] == pytest.approx(2.5)


@settings(max_examples=40, deadline=None)
@given(random_programs())
def test_compiled_walk_equals_its_python_source(prog):
    # the numba-compiled walk and the same function run as Python give the same bits
    import epsim.sim.step.executor.walk as engine_walk

    compiled = run_fast(prog)
    original = engine_walk.walk
    engine_walk.walk = original.py_func
    try:
        python = run_fast(prog)
    finally:
        engine_walk.walk = original
    for name in ("start", "end", "rank_end", "breakdown", "slowdown_s", "comm_busy"):
        assert np.array_equal(getattr(compiled, name), getattr(python, name), equal_nan=True)
