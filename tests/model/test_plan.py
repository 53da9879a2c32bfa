import pytest

from epsim.model import EpsimError, ParallelPlan, load_model, make_plan

R1 = load_model("deepseek-r1")


def test_defaults_are_dp_attention_with_ep():
    p = make_plan(R1)
    assert (p.dp, p.tp, p.ep, p.world_size) == (8, 1, 8, 8)
    assert p.expert_parallel and p.moe_tp == 1


def test_pure_tp_means_tensor_parallel_moe():
    p = make_plan(R1, tp=8)
    assert (p.dp, p.tp, p.ep, p.moe_tp) == (1, 8, 1, 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=3), "dp 3 does not divide the 8 GPUs"),
    (dict(dp=8, tp=2), "dp 8 x tp 2 = 16 does not match the 8 GPUs"),
    (dict(dp=8, ep=3), "ep 3 must be 1"),
    (dict(nodes=2, dp=16, ep=16, gpus_per_node=8, microbatches=3), "microbatches"),
])
def test_bad_plans_name_the_numbers(kwargs, message):
    with pytest.raises(EpsimError, match=message):
        make_plan(R1, **kwargs)


def test_ep_must_divide_experts():
    mixtral = load_model("mixtral-8x7b")
    with pytest.raises(EpsimError, match="ep 16 does not divide the 8 experts"):
        make_plan(mixtral, nodes=2, dp=16, ep=16)


def test_tp_must_divide_heads():
    tiny = load_model("tiny-deepseek")  # 4 heads
    with pytest.raises(EpsimError, match="tp 8 does not divide the 4 attention heads"):
        ParallelPlan(dp=1, tp=8, ep=1).validate(tiny)
