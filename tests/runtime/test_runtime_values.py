"""How the executor moves values along the op graph's edges, what a rank settles once when it is
built, and what the op implementations read of it (no ranks started)."""

import ast
from pathlib import Path

import pytest

pytest.importorskip("torch")

from epsim.model import Batch, build_step_graph, load_model, make_plan  # noqa: E402
from epsim.model.ids import NO_LAYER, op_id  # noqa: E402
from epsim.runtime.comm import DynamicExchange, StaticExchange  # noqa: E402
from epsim.runtime.executor import RankRuntime, _store, value_flow  # noqa: E402
from epsim.runtime.ops import RankView  # noqa: E402
from epsim.runtime.options import RunOptions, validate  # noqa: E402

TINY = load_model("tiny-deepseek")


@pytest.fixture(scope="module")
def graph():
    plan = make_plan(TINY, gpus_per_node=2, dp=2, ep=2, microbatches=2)
    return build_step_graph(TINY, plan, Batch.decode(4, 6))


def test_every_value_is_dropped_once_after_its_last_reader(graph):
    flow = value_flow(graph)
    position = {op_id: i for i, op_id in enumerate(graph.schedule.order())}
    dropped = [(producer, name, op_id) for op_id, keys in flow.release.items()
               for producer, name in keys]
    released_at = {producer: position[op_id] for producer, _, op_id in dropped}
    # every value is dropped once, all of a producer's values by the same op
    assert len({(producer, name) for producer, name, _ in dropped}) == len(dropped)
    assert all(released_at[producer] == position[op_id] for producer, _, op_id in dropped)
    assert {(producer, name) for producer, name, _ in dropped} == {
        (producer, name) for producer in released_at for name in graph.ops[producer].outputs}
    # the step's results (final hidden state, logits, next tokens) stay; everything else goes
    kept = {producer for results in graph.results for producer, _ in results.values()}
    assert kept == {op_id(NO_LAYER, name, mb) for name in ("final_norm", "lm_head", "sample")
                    for mb in (0, 1)}
    assert set(released_at) == set(graph.ops) - kept
    for producer, reader in graph.graph.edges:
        if producer not in kept:
            assert position[reader] <= released_at[producer], (producer, reader)


def test_an_op_must_write_exactly_the_values_the_graph_names(graph):
    values = {}
    norm = graph.op("L1.ffn_norm.mb0")
    _store(values, norm, {"h": 1.0, "residual": 2.0})
    assert values == {("L1.ffn_norm.mb0", "h"): 1.0, ("L1.ffn_norm.mb0", "residual"): 2.0}
    with pytest.raises(AssertionError, match="the graph says"):
        _store(values, norm, {"h": 1.0})


def _rank(**options) -> RankRuntime:
    """Rank 0 of a 2-rank EP run, built without a process group (building needs none)."""
    opts = RunOptions(model="tiny-deepseek", world_size=2, batch=2, context=4, steps=1, **options)
    return RankRuntime(opts, *validate(opts), rank=0)


@pytest.mark.parametrize("static", [False, True])
def test_a_rank_picks_its_exchange_once_when_built(static):
    rt = _rank(static=static)
    assert type(rt.exchange) is (StaticExchange if static else DynamicExchange)
    assert rt.exchange.slots_per_rank == rt.slots_per_rank and rt.exchange.group is rt.group


def test_a_rank_runtime_has_every_member_the_ops_read():
    assert isinstance(_rank(), RankView)


def test_the_ops_import_nothing_of_the_executor():
    """ops.py types its implementations against RankView: the executor imports ops, never the
    other way round (not even for type checking)."""
    ops = Path(__file__).resolve().parents[2] / "src" / "epsim" / "runtime" / "ops.py"
    imported = set()
    for node in ast.walk(ast.parse(ops.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert not [m for m in imported if "executor" in m.split(".")]
