"""EngineStepTime keeps each prefill shape's cost: the same cost, from the same variant, as
asking the variant's model again, without asking it."""

from epsim.sim.serving.step_time import EngineStepTime, StepCost, StepPolicy


class CountingModel:
    """A step-time model whose prefill costs 1 ms per new token plus 1 us per cached one (times
    ``scale``), counting the calls it gets."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.calls = 0

    def decode(self, seqs: int, context: int) -> StepCost:
        return StepCost(seconds=self.scale * 1e-3 * seqs)

    def prefill(self, seqs: int, prompt: int, prefix: int) -> StepCost:
        self.calls += 1
        return StepCost(seconds=self.scale * (1e-3 * seqs * (prompt - prefix) + 1e-6 * prefix))


def test_a_prefill_shape_met_again_is_not_costed_again_and_keeps_its_variant():
    # DBO above 1,000 prefill tokens: the two variants cost differently
    models = {False: CountingModel(1.0), True: CountingModel(0.5)}
    engine = EngineStepTime(lambda graph, dbo, with_prefill=False: models[dbo],
                            StepPolicy(dbo=True, dbo_min_prefill_tokens=1000))
    small = engine.prefill(1, 900, 100)  # 800 new tokens: one microbatch
    large = engine.prefill(2, 1000, 100)  # 1,800 new tokens: DBO
    assert small.seconds == 1e-3 * 800 + 1e-6 * 100
    assert large.seconds == 0.5 * (1e-3 * 1800 + 1e-6 * 100)
    assert engine.prefill(1, 900, 100) is small
    assert engine.prefill(2, 1000, 100) is large
    assert (models[False].calls, models[True].calls) == (1, 1)
    engine.prefill(1, 900, 200)  # another prefix: another shape
    assert models[False].calls == 2
    # the first use of each model is recorded, for the run's own evaluation count
    assert set(engine.touched) == {id(models[False]), id(models[True])}
