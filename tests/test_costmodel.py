"""The measured cost model: its formulas, the live refit, files, and a calibration on tiny models."""
from types import SimpleNamespace

import pytest

from engine.analysis.costmodel import CostModel, Measured, RoundTiming, calibrate_costs, from_trace


def model() -> CostModel:
    return CostModel(verify={1: Measured(1.0, 0.1), 5: Measured(2.0), 9: Measured(4.0)},
                     draft_step={"draft": Measured(0.25, 0.05)}, draft_fixed={"ngram": Measured(0.1)},
                     overhead={"none": Measured(0.2), "draft": Measured(0.3)})


def test_measured_median_and_spread():
    m = Measured.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert m.median == 3.0 and m.n == 5 and 0 < m.spread < 50
    assert Measured.of([]).n == 0


def test_verify_curve_interpolates_and_extends():
    costs = model()
    assert costs.t_verify(1) == 1.0 and costs.t_verify(3) == pytest.approx(1.5)
    assert costs.t_verify(7) == pytest.approx(3.0) and costs.t_verify(13) == pytest.approx(6.0)


def test_round_tpot_speedup_and_c():
    costs = model()
    assert costs.t_plain == pytest.approx(1.2)
    assert costs.t_round("draft", 4) == pytest.approx(4 * 0.25 + 2.0 + 0.3)
    assert costs.t_round("ngram", 8) == pytest.approx(0.1 + 4.0 + 0.2)  # fixed cost, plain overhead
    assert costs.tpot("draft", 4, 2.0) == pytest.approx(3.3 / 2.0)
    assert costs.speedup("draft", 4, 2.0) == pytest.approx(1.2 / (3.3 / 2.0))
    assert costs.c("draft") == pytest.approx(0.25) and costs.c("ngram") == pytest.approx(0.1)
    assert costs.c_spread("draft") == pytest.approx(0.25 * (0.1 + 0.2))
    assert "c = 0.250" in costs.describe("draft")


def test_refit_takes_the_runs_level_and_its_own_points():
    rounds = [RoundTiming("draft", 4, 5, 4, 2.0, 3.0, 0.5) for _ in range(5)]
    refitted = model().refit(rounds)
    assert refitted.t_verify(5) == pytest.approx(3.0)  # observed
    assert refitted.t_verify(1) == pytest.approx(1.5) and refitted.t_verify(9) == pytest.approx(6.0)  # x 1.5
    assert refitted.draft_step["draft"].median == pytest.approx(0.5)
    assert refitted.t_overhead("draft") == pytest.approx(0.5)
    assert model().t_verify(5) == 2.0  # the original is untouched
    assert refitted.source == "calibration + run"


def test_files_round_trip_and_trace_only_model():
    costs = model()
    again = CostModel.from_dict(costs.to_dict())
    assert again.to_dict() == costs.to_dict() and again.t_round("draft", 4) == costs.t_round("draft", 4)
    alone = from_trace([RoundTiming("draft", 4, 5, 4, 1.0, 2.0, 0.1)])
    assert alone.source == "trace only" and alone.t_verify(1) == alone.t_verify(5) == 2.0


def test_calibration_on_tiny_models(tiny_pair_dirs):
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    target, draft = tiny_pair_dirs
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))
    costs = calibrate_costs(decoder, "the cat sat", ["draft", "ngram"], k=2, repeats=2, warmup=1,
                            sizes=(1, 3, 9), tokens=6)
    assert set(costs.verify) == {1, 3, 9} and all(m.median > 0 for m in costs.verify.values())
    assert costs.draft_step["draft"].median > 0 and "ngram" in costs.draft_fixed
    assert costs.t_plain > 0 and costs.c("draft") > 0
    calibration = decoder.calibrate(2, repeats=2)
    assert calibration.costs is not None
    assert calibration.target_step_ms == pytest.approx(calibration.costs.t_plain)
    assert calibration.c_for("draft") == pytest.approx(calibration.c)


def test_a_hiccup_in_one_round_does_not_move_the_draft_step():
    """The step comes from the two depths' medians: one slow round (another process, a page fault) at the long
    depth leaves c where it was, while the fixed part still makes the long run's total add up."""
    def rounds(depth, ms, n=9):
        return [RoundTiming("draft", depth, depth + 1, depth, ms, 4.0, 0.2) for _ in range(n)]

    short, long = rounds(1, 1.5), rounds(4, 3.0)
    steady, hiccup = CostModel(verify={1: Measured(4.0)}), CostModel(verify={1: Measured(4.0)})
    steady.fit_draft("draft", short, long)
    hiccup.fit_draft("draft", short, long[:-1] + [RoundTiming("draft", 4, 5, 4, 30.0, 4.0, 0.2)])
    assert steady.draft_step["draft"].median == pytest.approx(0.5)
    assert hiccup.draft_step["draft"].median == pytest.approx(0.5)
    assert hiccup.c("draft") == pytest.approx(steady.c("draft"))
    mean_long = (8 * 3.0 + 30.0) / 9
    assert hiccup.draft_fixed["draft"].median + 4 * 0.5 == pytest.approx(mean_long)


def test_a_plain_round_costs_what_plain_rounds_took():
    """TPOT_plain is the plain rounds' own time when the model saw some, not the curve's one-token point plus
    the plain overhead: on a GPU plain decoding keeps two rounds in flight, so its verification phase is the
    device's time and its overhead the host's remainder, and the curve (timed block by block, in step) would
    count the host twice. A later run of another method only moves it by the machine's level."""
    curve = CostModel(verify={1: Measured(0.3), 2: Measured(0.32), 5: Measured(0.36)})
    plain = [RoundTiming("none", 0, 1, 0, 0.0, 0.15, 0.32) for _ in range(10)]  # 0.47 ms a round
    short = [RoundTiming("draft", 1, 2, 1, 0.2, 0.32, 0.3) for _ in range(5)]  # in step with the curve
    long = [RoundTiming("draft", 4, 5, 4, 0.2, 0.36, 0.3) for _ in range(5)]
    calibrated = curve.refit(plain + short + long, keep_shape=True)
    assert calibrated.t_plain == pytest.approx(0.47)
    assert calibrated.t_verify(1) + calibrated.t_overhead("none") > 0.6  # what the old sum gave
    draft = [RoundTiming("draft", 4, 5, 4, 0.2, 0.36 * 1.1, 0.3) for _ in range(5)]  # 10% slower machine
    assert calibrated.refit(draft).t_plain == pytest.approx(0.47 * 1.1)
    again = CostModel.from_dict(calibrated.to_dict())
    assert again.t_plain == pytest.approx(0.47) and again.plain == calibrated.plain
    unseen = CostModel(verify={1: Measured(1.0)}, overhead={"none": Measured(0.2)})
    assert unseen.t_plain == pytest.approx(1.2)  # no plain rounds: the curve's point and the overhead


def test_a_pipelined_model_keeps_its_plain_round_whatever_level_a_run_shows():
    """On the GPU's pipelined loop a run's verification phases are device time, the calibrated curve host and
    device in step: their ratio (0.6 here) says nothing about a plain round, which stays as measured."""
    curve = {1: Measured(0.5), 5: Measured(0.6)}
    plain = Measured(0.41)
    run = [RoundTiming("draft", 4, 5, 4, 0.2, 0.36, 0.3) for _ in range(5)]  # 0.6 of the curve's point
    in_step = CostModel(verify=dict(curve), plain=plain).refit(run)
    pipelined = CostModel(verify=dict(curve), plain=plain, pipelined=True).refit(run)
    assert in_step.t_plain == pytest.approx(0.41 * 0.6)
    assert pipelined.t_plain == pytest.approx(0.41) and pipelined.t_verify(5) == pytest.approx(0.36)
    assert CostModel.from_dict(pipelined.to_dict()).pipelined


def test_calibration_times_plain_rounds_from_the_second_on():
    """The first round of a generation also waits for the prefill on a GPU: TPOT_plain leaves it out."""
    import engine.analysis.costmodel as costmodel

    class Event:
        def __init__(self, index, ms):
            self.round, self.method, self.k, self.drafted = index, "none", 0, []
            self.draft_ms, self.verify_ms, self.overhead_ms = 0.0, ms, 0.0

    class Decoder:
        def verify_curve(self, prompt, sizes, warmup, repeats):
            return {n: Measured(1.0) for n in sizes}

        def generate(self, prompt, config):
            return [Event(0, 50.0)] + [Event(i, 1.0) for i in range(1, config.max_new_tokens)]

    costs = costmodel.calibrate_costs(Decoder(), "x", ["none"], tokens=8)
    assert costs.t_plain == pytest.approx(1.0)  # the 50 ms first round left out


def test_calibration_times_every_configuration_round_robin_with_the_runs_sampling():
    """A slow stretch of the machine must land on every configuration alike: after each one's warm-up and a
    spin-up, the timed generations go plain, draft K=1, draft K=4, plain, ...; all at the given sampling."""
    import engine.analysis.costmodel as costmodel
    from engine.config import SamplingParams

    class Event:
        def __init__(self, index, config):
            self.round, self.method, self.k = index, config.method, config.k
            depth = config.k if config.method != "none" else 0
            self.drafted = [SimpleNamespace(depth=d) for d in range(depth)]
            self.draft_ms, self.verify_ms, self.overhead_ms = 0.1 * len(self.drafted), 1.0, 0.1

    class Decoder:
        def __init__(self):
            self.runs = []

        def verify_curve(self, prompt, sizes, warmup, repeats):
            return {n: Measured(1.0) for n in sizes}

        def generate(self, prompt, config):
            self.runs.append((config.method, config.k, config.max_new_tokens, config.sampling.temperature))
            return [Event(i, config) for i in range(config.max_new_tokens)]

    decoder = Decoder()
    costs = costmodel.calibrate_costs(decoder, "x", ["draft"], k=4, repeats=4, warmup=2, tokens=6,
                                      sampling=SamplingParams(temperature=0.8))
    timed = [run[:2] for run in decoder.runs if run[2] == 6]
    spun = len(timed) - 6  # spin-up generations are plain ones of the timed length
    assert spun >= 1 and timed[:spun] == [("none", 4)] * spun
    assert timed[spun:] == [("none", 4), ("draft", 1), ("draft", 4)] * 2
    assert {run[3] for run in decoder.runs} == {0.8}
    assert costs.draft_step["draft"].median == pytest.approx(0.1)


def test_a_k_sweeps_live_prediction_times_each_round_at_the_block_it_verified():
    """n-gram drafts as far as its match goes: rounds of 1 and of K + 1 rows. The row's predicted speedup
    takes each round at its own block, not one typical block for all."""
    from engine.bench.suite import RunTotals, _sweep_row
    from engine.core.metrics import MetricsAccumulator

    def round_event(drafted: int, verify_ms: float):
        tokens = [SimpleNamespace(depth=d) for d in range(drafted)]
        return SimpleNamespace(method="ngram", k=4, drafted=tokens, draft_ms=0.1, verify_ms=verify_ms,
                               overhead_ms=0.2)

    costs = CostModel(verify={1: Measured(1.0), 5: Measured(2.0)}, overhead={"none": Measured(0.2)},
                      draft_fixed={"ngram": Measured(0.1)})
    events = list(enumerate([round_event(0, 1.0), round_event(4, 2.0)] * 5))  # misses, then whole chains
    totals = RunTotals(4)
    totals.add(MetricsAccumulator(4).add_round(4, 4, 5, 4, 0.1, 2.0, 0.2))  # 3 tokens a round, say
    totals.add(MetricsAccumulator(4).add_round(0, 0, 1, 0, 0.1, 1.0, 0.2))
    row = _sweep_row(4, totals, 100.0, 0.1, costs, events)
    mean_round = (1.0 + 2.0) / 2 + 0.1 + 0.2  # verify at its own block, the draft and the overhead
    assert row["predicted_speedup"] == pytest.approx(costs.t_plain / (mean_round / totals.tokens_per_forward))
