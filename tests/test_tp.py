"""Tensor-parallel target (--tp 2 over gloo): the same greedy tokens as one rank for every method, lossless
sampling, clean errors for bad uses. The process group is started once for the module."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_tree_methods import add_random_eagle_head, add_random_medusa_heads
from tiny_models import make_tiny_gpt2, make_tiny_llama

from engine.analysis.lossless import check_sampling
from engine.cli.main import main
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.models import tp
from engine.models.loading import load_pair

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a tea at the tea at the"
VOCAB = 25  # odd: the LM head's vocabulary shards are padded
GREEDY_SPECS = ["none", "draft", "ngram", "medusa", "eagle", "eagle:8", "lookahead", "suffix"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target = make_tiny_llama(root / "target", vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, seed=11,
                             std=0.3)
    draft = make_tiny_llama(root / "draft", vocab=VOCAB, hidden=32, layers=1, heads=4, kv_heads=2, seed=1,
                            std=0.3)
    add_random_medusa_heads(target, 32)
    add_random_eagle_head(target, 32)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def decoders(models):
    """(one rank, two ranks) decoders over the same pair, fp32 on the CPU."""
    target, draft = models
    single = SpeculativeDecoder(load_pair(target, draft, device="cpu", dtype="float32"))
    split = SpeculativeDecoder(tp.load_pair(target, draft, 2, device="cpu", dtype="float32"))
    yield single, split
    tp.shutdown()


def config_for(spec, **kw):
    return GenerationConfig(**kw).with_spec(spec)


def test_shards_put_the_full_lm_head_back_together(models):
    shards = [tp.vocab_shard(torch.arange(VOCAB * 2.0).view(VOCAB, 2), r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [13, 13]
    assert torch.equal(torch.cat(shards)[:VOCAB], torch.arange(VOCAB * 2.0).view(VOCAB, 2))


def test_split_target_has_the_same_logits(decoders):
    single, split = decoders
    assert split.target.tp == 2 and split.target.shard.spec.num_heads == 2
    tokens = torch.tensor([3, 4, 5, 6, 7])
    for runner in (single.target, split.target):
        runner.reset()
    a, b = single.target.forward(tokens), split.target.forward(tokens)
    assert torch.allclose(a.logits, b.logits, atol=1e-4) and torch.allclose(a.hidden, b.hidden, atol=1e-4)
    parents = torch.tensor([-1, 0, 0, 1])  # a tree block after the chain
    a, b = single.target.forward(tokens[:4], parents), split.target.forward(tokens[:4], parents)
    assert torch.allclose(a.logits, b.logits, atol=1e-4)
    for runner in (single.target, split.target):
        runner.compact(5, torch.tensor([0, 2]))
        runner.rollback(6)
    a, b = single.target.forward(tokens[:2]), split.target.forward(tokens[:2])
    assert torch.allclose(a.logits, b.logits, atol=1e-4)


@pytest.mark.parametrize("spec", GREEDY_SPECS)
def test_two_ranks_give_the_same_greedy_tokens(decoders, spec):
    single, split = decoders
    config = config_for(spec, k=3, max_new_tokens=32, stop_at_eos=False)  # first token: EOS
    plain = single.generate_ids(PROMPT, config_for("none", max_new_tokens=32, stop_at_eos=False))
    events = list(split.generate(PROMPT, config))
    assert [t for e in events for t in e.emitted_ids] == single.generate_ids(PROMPT, config) == plain
    if spec not in ("none", "draft"):  # the random draft model agrees with the target about once
        assert sum(e.accepted_count for e in events) >= 3, "expected accepted drafts (rollback, compaction)"


@pytest.mark.slow  # a statistical check: `make test-fast` skips it
@pytest.mark.parametrize("spec", ["draft", "eagle:8"])
def test_two_ranks_sample_losslessly(decoders, spec):
    _, split = decoders
    config = config_for(spec, k=3, sampling=SamplingParams(0.8, 0, 0.9), seed=500)
    report = check_sampling(split, PROMPT, config, samples=400)
    assert report.passed, report


def test_bench_runtimes_reports_the_all_reduce_time_per_step(decoders):
    from engine.bench.runtimes import time_specplay

    _, split = decoders
    row = time_specplay(split, [PROMPT], config_for("none", max_new_tokens=8), "specplay none")
    assert row.note.startswith("tp=2: all-reduce ") and row.note.endswith(" ms/step")
    assert float(row.note.split()[2]) > 0


def test_layer_skip_is_refused_with_a_clear_error(decoders):
    _, split = decoders
    with pytest.raises(SpecplayError, match="tensor-parallel"):
        split.generate_ids(PROMPT, config_for("layerskip", k=2, max_new_tokens=4))


def run_cli(capsys, *argv):
    code = main(list(argv))
    _, err = capsys.readouterr()
    return code, err


@pytest.mark.parametrize("extra, needle", [(["--tp", "3"], "not divisible by 3"),
                                           (["--tp", "0"], "at least 1"),
                                           (["--tp", "-2"], "at least 1")])
def test_bad_tp_gives_one_line_and_exit_2(models, capsys, extra, needle):
    code, err = run_cli(capsys, "run", "--target", models[0], "--prompt", "x", "--device", "cpu",
                        "--method", "none", *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_tp_with_a_non_llama_target_exits_2(tmp_path, capsys):
    gpt2 = make_tiny_gpt2(tmp_path / "gpt2")
    capsys.readouterr()  # the model writer's progress bar
    code, err = run_cli(capsys, "run", "--target", str(gpt2), "--prompt", "x", "--device", "cpu",
                        "--method", "none", "--tp", "2")
    assert code == 2 and "Llama-family" in err and len(err.strip().splitlines()) == 1


def test_more_ranks_than_gpus_is_refused(models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spec = tp.target_spec(Path(models[0]))
    with pytest.raises(SpecplayError, match="more ranks than GPUs"):
        tp.check_tp(2, spec, torch.device("cuda"))


def test_cli_run_with_two_ranks_exits_cleanly(models):
    """The whole path from main.py: spawn, serve, STOP, join; no hang (the timeout would fail the test)."""
    target, draft = models
    argv = [sys.executable, str(REPO / "main.py"), "run", "--target", target, "--draft", draft, "--method",
            "draft", "--prompt", PROMPT, "--max-new-tokens", "8", "--device", "cpu", "--tp", "2", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_ctrl_c_stops_every_rank(models):
    """SIGINT to rank 0 mid-run: exit code 130 (interrupted), and no worker left behind."""
    target, draft = models
    argv = [sys.executable, str(REPO / "main.py"), "check-lossless", "--target", target, "--draft", draft,
            "--method", "draft", "--samples", "5000", "--device", "cpu", "--tp", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env, start_new_session=True, preexec_fn=_default_sigint)
    try:
        assert "greedy" in proc.stdout.readline()  # rank 0 is sampling now, the workers serving
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "a worker rank outlived rank 0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _default_sigint() -> None:
    """A background shell starts children with SIGINT ignored; the test's rank 0 must feel it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_qwen2_biases_and_tied_head_split_the_same(tmp_path):
    """q/k/v biases (Qwen2) are split with their weights; a tied LM head is split from the embedding. Runs
    last: it replaces the module's group with its own."""
    target = make_tiny_llama(tmp_path / "qwen2", arch="qwen2", vocab=VOCAB, hidden=32, layers=2, seed=3,
                             tie=True, std=0.3)
    single = load_pair(str(target), None, device="cpu", need_draft=False, dtype="float32").target
    split = tp.load_pair(str(target), None, 2, device="cpu", need_draft=False, dtype="float32").target
    tokens, parents = torch.tensor([3, 4, 5, 6]), torch.tensor([-1, 0, 0, 2])
    for runner in (single, split):
        runner.reset()
    assert torch.allclose(single.forward(tokens).logits, split.forward(tokens).logits, atol=1e-4)
    assert torch.allclose(single.forward(tokens, parents).logits, split.forward(tokens, parents).logits,
                          atol=1e-4)
    tp.shutdown()
