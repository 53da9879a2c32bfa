"""Only the attention cores of a step read its batch's context (``model.graph.CONTEXT_KINDS``):
a batch costed at one context is recosted at another from its attention cores alone
(``sim.step.compile``), which holds only if every other op is the same at every context."""

import dataclasses

import pytest

from epsim.model import Batch, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.model.graph import CONTEXT_KINDS, build_representative_ops
from epsim.model.opgraph import Op
from epsim.model.shipped import shipped_names

FIELDS = tuple(f.name for f in dataclasses.fields(Op))  # every field, as new ones are added


def _fields(op):
    return [getattr(op, f) for f in FIELDS]


def _plans(model):
    layouts = [dict(dp=8, ep=8), dict(tp=8), dict(tp=4), dict(dp=8, ep=8, microbatches=1),
               dict(dp=2, ep=2)]
    if model.mtp_layers:
        layouts.append(dict(dp=8, ep=8, mtp=2))
    plans = []
    for kw in layouts:
        try:
            plan = make_plan(model, **kw)
            plan.validate(model)
        except EpsimError:  # a layout this model cannot run (heads or experts per rank)
            continue
        plans.append(plan)
    assert plans
    return plans


# per case: batches with the same phase, sequences and new tokens per sequence
FAMILIES = [
    [Batch.decode(37, c) for c in (1, 17, 900, 4097, 20000)],
    [Batch.decode(1, c) for c in (5, 128, 3000)],
    [Batch.prefill(2, prompt, prompt - 512) for prompt in (512, 700, 3000, 9000)],
    [Batch.prefill(3, prompt, prompt - 64) for prompt in (64, 4000)],
]


@pytest.mark.parametrize("name", shipped_names("epsim.model", "configs"))
def test_only_the_attention_cores_read_the_context(name):
    model = load_model(name)
    for plan in _plans(model):
        for family in FAMILIES:
            first = build_representative_ops(model, plan, family[0])
            assert any(op.kind in CONTEXT_KINDS for op in first.values())
            for batch in family[1:]:
                other = build_representative_ops(model, plan, batch)
                assert other.keys() == first.keys()
                for ident, op in other.items():
                    if op.kind not in CONTEXT_KINDS:
                        assert _fields(op) == _fields(first[ident]), (name, plan, batch, ident)
                # the cores alone, as the full build has them
                cores = build_representative_ops(model, plan, batch, CONTEXT_KINDS)
                assert cores.keys() == {i for i, op in other.items() if op.kind in CONTEXT_KINDS}
                assert all(_fields(op) == _fields(other[i]) for i, op in cores.items())
