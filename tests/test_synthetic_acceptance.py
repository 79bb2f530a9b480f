"""Synthetic acceptance (issue 55): verification runs as usual, the verdict follows a seeded profile; every
output says so, the losslessness checks refuse it, bad profiles are refused in one line."""
import csv
import json
import math
import statistics

import pytest
import torch
from spec_fixtures import make_close_pair_dirs

from engine.analysis.analytic import expected_tokens
from engine.analysis.lossless import check_greedy, check_sampling, target_next_logits
from engine.cli.main import main
from engine.config import GenerationConfig
from engine.core.batch import BatchDecoder
from engine.core.decoder import SpeculativeDecoder, _RoundReadout, synthetic_verdict
from engine.core.synthetic import SyntheticAcceptance
from engine.errors import SpecplayError
from engine.files.trace import read_trace
from engine.methods.base import Draft
from engine.models.loading import load_pair

PROMPTS = ["the cat sat on the mat. the cat", "def f(x):\n    return x", "hello world, hello"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_close_pair_dirs(tmp_path_factory.mktemp("synthetic"))


@pytest.fixture(scope="module")
def decoder(dirs):
    return SpeculativeDecoder(load_pair(dirs[0], dirs[1], device="cpu", dtype=torch.float32))


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def full_rounds(decoder, config, prompts=PROMPTS) -> list:
    """The rounds that drafted all K positions (a generation's last round may be cut by its budget)."""
    rounds = []
    for prompt in prompts:
        events = list(decoder.generate(prompt, config))
        rounds += [e for e in events[:-1] if len(e.drafted) == config.k]
    return rounds


def tolerance(rates: list, rounds: int, sigmas: float = 4.0) -> float:
    """sigmas standard errors of the mean tokens per round under the rates (exact variance)."""
    probs, survive = [], 1.0
    for rate in rates + [0.0]:  # P(exactly a accepted)
        probs.append(survive * (1 - rate))
        survive *= rate
    mean = sum((a + 1) * p for a, p in enumerate(probs))
    var = sum((a + 1 - mean) ** 2 * p for a, p in enumerate(probs))
    return sigmas * math.sqrt(var / rounds)


# ------------------------------------------------------------------------------------------------ profiles
def test_a_length_becomes_one_rate_whose_textbook_e_is_the_length():
    for k, length in ((4, 3.2), (2, 1.5), (8, 6.0)):
        profile = SyntheticAcceptance.parse(str(length))
        rates = profile.position_rates(k)
        assert len(set(rates)) == 1
        assert expected_tokens(rates[0], k) == pytest.approx(length, abs=1e-9)
        assert profile.expected_tokens(k) == pytest.approx(length, abs=1e-9)
    assert SyntheticAcceptance.parse("1").position_rates(3) == [0.0] * 3
    assert SyntheticAcceptance.parse("5").position_rates(4) == [1.0] * 4


def test_rates_past_the_list_repeat_its_last():
    profile = SyntheticAcceptance.parse("0.9, 0.5")
    assert profile.position_rates(4) == [0.9, 0.5, 0.5, 0.5]
    assert profile.expected_tokens(4) == pytest.approx(1 + 0.9 + 0.45 + 0.225 + 0.1125)
    assert SyntheticAcceptance.parse("0.8,").position_rates(3) == [0.8] * 3
    assert SyntheticAcceptance.parse(profile.text) == profile  # the canonical spelling reads back


@pytest.mark.parametrize("text, k, words", [
    ("5.5", 4, "outside 1..K+1"), ("0.5", 4, "outside 1..K+1"), ("nan", 4, "finite"),
    ("0.9,nan", 4, "finite"), ("0.9,1.5", 4, "[0, 1]"), ("0.9,-0.1", 4, "[0, 1]"),
    ("0.9,0.8,0.7", 2, "at most K"), ("fast", 4, "a length such as"), (",", 4, "none given")])
def test_bad_profiles_are_refused(text, k, words):
    with pytest.raises(SpecplayError, match=words.replace("[", r"\[").replace("+", r"\+")):
        GenerationConfig(method="draft", k=k, synthetic_acceptance=text).validate()


@pytest.mark.parametrize("argv", [
    ("run", "--prompt", "a", "--k", "2", "--synthetic-acceptance", "3.5"),
    ("bench", "methods", "--k", "2", "--synthetic-acceptance", "0.9,0.8,0.7"),
    ("bench", "k-sweep", "--ks", "1,4", "--k", "4", "--synthetic-acceptance", "3"),
    ("bench", "runtimes", "--synthetic", "tiny", "--synthetic-acceptance", "nan"),
    ("bench", "batch", "--synthetic-acceptance", "1.2,"),
    ("bench", "batch", "--acceptance", "0.5", "--synthetic-acceptance", "0.5,")])
def test_bad_profiles_on_the_cli_are_one_line_and_status_2(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ decoding
def test_the_mean_length_is_followed(decoder):
    config = GenerationConfig(method="draft", k=4, max_new_tokens=200, stop_at_eos=False,
                              synthetic_acceptance="3.2")
    rounds = full_rounds(decoder, config)
    assert len(rounds) > 100
    measured = statistics.fmean(e.accepted_count + 1 for e in rounds)
    rates = SyntheticAcceptance.parse("3.2").position_rates(4)
    allowed = tolerance(rates, len(rounds))
    assert abs(measured - 3.2) < allowed
    assert abs(measured - 2.7) > allowed  # the tolerance tells lengths half a token apart
    assert all(e.synthetic_acceptance == "3.2" for e in rounds)
    again = full_rounds(decoder, config)  # seeded: the same draws
    assert [e.accepted_count for e in again] == [e.accepted_count for e in rounds]


def test_per_position_rates_are_followed(decoder):
    config = GenerationConfig(method="draft", k=3, max_new_tokens=200, stop_at_eos=False,
                              synthetic_acceptance="0.9,0.5,0.2")
    rounds = full_rounds(decoder, config)
    for depth, rate in enumerate((0.9, 0.5, 0.2)):
        reached = [e for e in rounds if e.accepted_count >= depth]
        accepted = sum(e.accepted_count > depth for e in reached) / len(reached)
        assert abs(accepted - rate) < 4 * math.sqrt(rate * (1 - rate) / len(reached)) + 1e-9, depth
    exact = GenerationConfig(method="draft", k=3, max_new_tokens=60, stop_at_eos=False,
                             synthetic_acceptance="1,1,0")
    assert {e.accepted_count for e in full_rounds(decoder, exact)} == {2}


def test_the_token_after_a_synthetic_verdict_is_the_targets(decoder):
    """After the accepted drafts the target's own greedy token follows: valid text, though not the model's."""
    config = GenerationConfig(method="draft", k=4, max_new_tokens=40, stop_at_eos=False,
                              synthetic_acceptance="0.7,")
    prompt = PROMPTS[0]
    context = decoder.prompt_ids(prompt)
    rounds = list(decoder.generate(prompt, config))
    for event in rounds[:6]:
        accepted = [d.token_id for d in event.drafted if d.accepted]
        assert len(accepted) == event.accepted_count
        expected = int(target_next_logits(decoder, context + accepted).argmax())
        assert event.next_token_id == expected
        context += event.emitted_ids


def test_plain_decoding_is_not_marked(decoder):
    config = GenerationConfig(method="none", k=4, max_new_tokens=8, synthetic_acceptance="3.2")
    assert all(e.synthetic_acceptance == "" for e in decoder.generate(PROMPTS[0], config))
    assert config.plain().synthetic_acceptance == ""


def test_a_tree_verdict_is_a_path_of_the_drawn_depth():
    """A tree's synthetic path follows the device's path as far as it fits, then goes deep enough."""
    parents = [-1, -1, 0, 1, 3, 3]  # depths 0 0 1 1 2 2; node 1's branch is the deep one
    n = len(parents)
    readout = _RoundReadout(next_token=7, path=[0, 2], draft_tokens=list(range(10, 16)), p=[0.5] * n,
                            q=[1.0] * n, accept_prob=[1.0] * n, tested=[1.0] * n, next_p=0.5,
                            top_p=[[0.6, 0.4]] * (n + 1), top_i=[[20 + r, 40 + r] for r in range(n + 1)])
    draft = Draft(tokens=torch.arange(10, 16), parents=torch.tensor(parents))

    class Fixed:
        def __init__(self, a):
            self.a = a

        def accepted(self, drafted):
            return [min(self.a, d) for d in drafted]

    assert synthetic_verdict(readout, draft, Fixed(2)).path == [0, 2]  # the device's own path
    deep = synthetic_verdict(readout, draft, Fixed(3))
    assert deep.path == [1, 3, 4] and deep.next_token == 25 and deep.next_p == 0.6
    assert deep.tested == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    none = synthetic_verdict(readout, draft, Fixed(0))
    assert none.path == [] and none.next_token == 20


def test_the_batched_decoder_follows_the_same_profile(dirs):
    batched = BatchDecoder(load_pair(dirs[0], dirs[1], device="cpu", dtype=torch.float32))
    config = GenerationConfig(method="draft", k=4, max_new_tokens=120, stop_at_eos=False,
                              synthetic_acceptance="3.2")
    result = batched.generate(PROMPTS * 2, config, until_first_done=True)
    rounds = sum(result.outcomes.values())
    measured = sum((acc + 1) * times for (_, acc), times in result.outcomes.items()) / rounds
    rates = SyntheticAcceptance.parse("3.2").position_rates(4)
    assert abs(measured - 3.2) < tolerance(rates, rounds)
    assert result.summary()["synthetic_acceptance"] == "3.2"


# ------------------------------------------------------------------------------------------------ outputs
def test_run_exports_and_summary_say_it_is_not_model_output(dirs, capsys, tmp_path):
    target, draft = dirs
    csv_path, trace_path = tmp_path / "m.csv", tmp_path / "t.jsonl"
    code, out, err = run_cli(capsys, "run", "--target", target, "--draft", draft, "--prompt", PROMPTS[0],
                             "--k", "3", "--max-new-tokens", "20", "--synthetic-acceptance", "0.9,0.5",
                             "--csv", str(csv_path), "--trace", str(trace_path))
    assert code == 0, err
    assert "SYNTHETIC acceptance: the text is not model output" in err
    with open(csv_path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and {row["synthetic_acceptance"] for row in rows} == {"0.9,0.5"}
    header = json.loads(trace_path.read_text(encoding="utf-8").splitlines()[0])
    assert header["synthetic_acceptance"] == "0.9,0.5" and "not model output" in header["note"]
    run = read_trace(trace_path)[0]  # the validating reader takes it
    assert run.config.synthetic_acceptance == "0.9,0.5"
    assert all(e.synthetic_acceptance == "0.9,0.5" for e in run.events)
    code, out, err = run_cli(capsys, "run", "--target", target, "--draft", draft, "--prompt", PROMPTS[0],
                             "--k", "3", "--max-new-tokens", "8", "--synthetic-acceptance", "2", "--json")
    assert code == 0 and json.loads(out)["synthetic_acceptance"] == "2"


def test_losslessness_checks_refuse_it(dirs, decoder, capsys):
    config = GenerationConfig(method="draft", k=3, max_new_tokens=8, synthetic_acceptance="2")
    with pytest.raises(SpecplayError, match="synthetic"):
        check_greedy(decoder, PROMPTS[0], config)
    with pytest.raises(SpecplayError, match="synthetic"):
        check_sampling(decoder, PROMPTS[0], config, samples=10)
    code, out, err = run_cli(capsys, "check-lossless", "--target", dirs[0], "--draft", dirs[1],
                             "--synthetic-acceptance", "2")
    assert code == 2 and err.count("\n") == 1 and "synthetic" in err


# ------------------------------------------------------------------------------------------------ runtimes
def hand_costs():
    """A cost model with round figures: t_verify(1) = 2 ms, (5) = 3 ms; the draft model 0.5 ms a step."""
    from engine.analysis.costmodel import CostModel, Measured

    return CostModel(verify={1: Measured(2.0), 5: Measured(3.0)}, draft_step={"draft": Measured(0.5)},
                     overhead={"none": Measured(0.1), "draft": Measured(0.2)}, plain=Measured(2.1))


def test_the_runtimes_table_prints_the_prediction_beside_the_measurement(monkeypatch, capsys):
    from engine.core.decoder import Calibration

    calls = []

    def calibrate(self, k=4, repeats=5, methods_to_time=None, prompt="", sampling=None):
        calls.append((k, tuple(methods_to_time)))
        return Calibration(target_step_ms=2.1, draft_step_ms=0.5, costs=hand_costs())

    monkeypatch.setattr(SpeculativeDecoder, "calibrate", calibrate)
    code, out, err = run_cli(capsys, "bench", "runtimes", "--synthetic", "tiny", "--methods", "draft,medusa",
                             "--synthetic-acceptance", "3.2", "--k", "4", "--hf", "none", "--prompts", "1",
                             "--max-new-tokens", "24", "--device", "cpu", "--json")
    assert code == 0, err
    # plain decoding added for the speedups; medusa runs the synthetic pair's random-weight Medusa-1 heads
    assert calls == [(4, ("none", "draft", "medusa"))]
    report = json.loads(out)
    assert report["synthetic_acceptance"] == "3.2" and not report["left_out"]
    rows = {r["runtime"]: r for r in report["rows"]}
    draft, plain = rows["specplay draft"]["predicted"], rows["specplay none"]["predicted"]
    round_ms = 0.5 * 4 + 3.0 + 0.2  # t_draft(4) + t_verify(5) + overhead
    assert draft["round_ms"] == pytest.approx(round_ms) and draft["e"] == pytest.approx(3.2)
    assert draft["tokens_per_s"] == pytest.approx(1000 * 3.2 / round_ms)
    assert draft["speedup"] == pytest.approx(2.1 / (round_ms / 3.2))
    assert draft["textbook_speedup"] == pytest.approx(3.2 / (1 + 0.25 * 4))
    measured = rows["specplay draft"]
    assert draft["measured_e"] == pytest.approx(measured["tokens"] / measured["forwards"])
    assert draft["measured_speedup"] == pytest.approx(
        measured["round_tokens_per_s"] / rows["specplay none"]["round_tokens_per_s"])
    assert plain["speedup"] == 1.0


def test_the_text_table_has_both_columns(monkeypatch, capsys):
    from engine.bench import runtimes

    row = runtimes.RuntimeRow("specplay draft", tokens=64, forwards=20, draft_ms=40.0, verify_ms=60.0,
                              round_ms=110.0, depth=80, depths={4: 20}, spec="draft", k=4)
    plain = runtimes.RuntimeRow("specplay none", tokens=64, forwards=64, verify_ms=128.0, round_ms=140.8,
                                depth=0, depths={0: 64}, spec="none", k=4)
    report = runtimes.RuntimesReport([plain, row], "CPU", 0.0, 0, 0.0, 1, 64, synthetic_acceptance="3.2")
    runtimes.add_predictions(report, hand_costs(), GenerationConfig(method="draft", k=4,
                                                                    synthetic_acceptance="3.2"))
    text = runtimes.format_report(report)
    line = next(t for t in text.splitlines() if t.startswith("draft "))
    # E measured 64 / 20 beside 3.2; c measured (40 / 80) / (128 / 64) beside 0.5 / 2; round ms 5.5 / 5.2
    assert "3.20/3.20" in line and "0.250/0.250" in line and "5.500/5.200" in line
    assert "not model output" in text.splitlines()[-1]


def test_a_tree_is_predicted_at_the_depths_it_drafted():
    """A shallow tree cannot accept past its depth: E is the profile's at each round's depth."""
    from engine.bench.runtimes import expected_at_depths
    from engine.core.synthetic import SyntheticAcceptance

    profile = SyntheticAcceptance.parse("0.8,")
    assert expected_at_depths(profile, 4, {4: 10}) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_at_depths(profile, 4, {2: 3, 1: 1}) == pytest.approx((3 * (1 + 0.8 + 0.64) + 1.8) / 4)
    assert expected_at_depths(profile, 4, {}) == pytest.approx(profile.expected_tokens(4))


def test_runtimes_runs_each_method_at_each_k(monkeypatch, capsys):
    from engine.core.decoder import SpeculativeDecoder

    calls = []

    def calibrate(self, k=4, repeats=5, methods_to_time=None, prompt="", sampling=None):
        from engine.core.decoder import Calibration

        calls.append(k)
        return Calibration(target_step_ms=2.1, draft_step_ms=0.5, costs=hand_costs())

    monkeypatch.setattr(SpeculativeDecoder, "calibrate", calibrate)
    code, out, err = run_cli(capsys, "bench", "runtimes", "--synthetic", "tiny", "--methods", "draft",
                             "--synthetic-acceptance", "0.7,", "--ks", "2,3", "--hf", "none",
                             "--prompts", "1", "--max-new-tokens", "16", "--device", "cpu", "--json")
    assert code == 0, err
    rows = {r["runtime"]: r for r in json.loads(out)["rows"]}
    assert sorted(rows) == ["specplay draft K=2", "specplay draft K=3", "specplay none"]
    for k in (2, 3):
        predicted = rows[f"specplay draft K={k}"]["predicted"]
        assert predicted["round_ms"] == pytest.approx(0.5 * k + hand_costs().t_verify(k + 1) + 0.2)
        assert predicted["e"] == pytest.approx(sum(0.7 ** i for i in range(k + 1)), rel=0.05)
    code, _, err = run_cli(capsys, "bench", "runtimes", "--synthetic", "tiny", "--methods", "draft",
                           "--synthetic-acceptance", "3.2", "--ks", "2,4", "--hf", "none", "--device", "cpu")
    assert code == 2 and "3.2" in err and len(err.strip().splitlines()) == 1


def test_a_short_run_reaches_the_profiles_mean():
    """Eight rounds at K = 8 and rate 0.8 (E 4.33): the sampler's even-spread draws keep a run's mean near E
    (independent draws strayed by 0.81 on average and up to 3.3 over the same seeds)."""
    profile = SyntheticAcceptance.parse("0.8,")
    expected = profile.expected_tokens(8)
    errors = []
    for seed in range(50):
        counts = profile.sampler(8, seed).accepted([8] * 8)
        errors.append(abs(statistics.fmean(1 + a for a in counts) - expected))
    assert statistics.fmean(errors) < 0.45 and max(errors) < 1.0
    assert profile.sampler(8, 3).accepted([8] * 5) == profile.sampler(8, 3).accepted([8] * 5)  # seeded
    assert profile.sampler(8, 3).accepted([2, 0, 8])[1] == 0  # never past what was drafted
