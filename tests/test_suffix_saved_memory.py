"""A saved suffix-decoding trace replays every K exactly where its headers fingerprint the session's memory
(engine.methods.suffix.drafter.memory_fingerprint) and the trace's own earlier generations rebuild it:
`predict
--trace` and a History generation read back from a trace then predict as a live run does."""
import json

import pytest
from spec_fixtures import target_only_decoder

from engine.analysis.predict import load_trace, predict_tokens_per_forward, replayed_rounds
from engine.cli.main import main
from engine.config import GenerationConfig
from engine.files.trace import Run, make_header, trace_records
from engine.methods.suffix.drafter import memory_fingerprint, memory_from_generations

PROMPTS = ["the cat sat on the mat. the cat sat on the", "the mat. the cat sat", "on the mat the cat sat on"]


@pytest.fixture
def decoder(tiny_pair_dirs):
    return target_only_decoder(tiny_pair_dirs[0])  # the tiny pair's target (conftest.py) alone


def _session(decoder, config) -> list:
    """Each prompt generated in one session: (prompt ids, events, the memory it began with)."""
    out = []
    for prompt in PROMPTS:
        events = list(decoder.generate(prompt, config))
        out.append((decoder.prompt_ids(prompt), events, list(decoder.suffix_memory().begun_with)))
    return out


def test_the_earlier_generations_rebuild_each_generations_memory(decoder, tmp_path):
    session = _session(decoder, GenerationConfig(method="suffix", k=4, max_new_tokens=24, stop_at_eos=False))
    earlier = []
    for ids, events, documents in session:
        fingerprint = memory_fingerprint(documents, decoder.vocab_size)
        assert memory_from_generations(earlier, fingerprint) == documents
        earlier.append((ids, [t for e in events for t in e.emitted_ids]))
    assert len(session[-1][2]) == 2  # the last began with both earlier generations
    last = memory_fingerprint(session[-1][2], decoder.vocab_size)
    assert memory_from_generations(earlier[:1], last) is None  # a generation the reader lacks
    assert memory_from_generations([(earlier[0][0], earlier[0][1][:-1]), earlier[1]], last) is None
    assert memory_from_generations(earlier, None) is None and memory_from_generations(earlier, {}) is None
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat " * 20)
    decoder.suffix_memory().load_corpus(str(corpus), decoder.tokenizer)
    list(decoder.generate(PROMPTS[0], GenerationConfig(method="suffix", k=4, max_new_tokens=8)))
    with_corpus = memory_fingerprint(decoder.suffix_memory().begun_with, decoder.vocab_size)
    assert memory_from_generations(earlier, with_corpus) is None  # a corpus: not in any trace


def _write(decoder, session, config, path, fingerprints=True) -> str:
    runs = []
    for number, (ids, events, documents) in enumerate(session, 1):
        header = make_header(PROMPTS[number - 1], config, "tiny", device="cpu", generation=number,
                             prompt_ids=ids)
        if fingerprints:
            header["suffix_memory"] = memory_fingerprint(documents, decoder.vocab_size)
        runs.append(Run(header=header, events=events, finish=events[-1].finish_reason))
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in trace_records(runs))
    return str(path)


@pytest.mark.parametrize("k", [2, 4])
def test_a_saved_session_replays_at_every_k_as_the_runs_went(decoder, tmp_path, k):
    config = GenerationConfig(method="suffix", k=4, max_new_tokens=24, stop_at_eos=False)
    before = decoder.session_state()
    session = _session(decoder, config)
    trace = load_trace(_write(decoder, session, config, tmp_path / "session.jsonl"))
    assert trace.replay is not None
    rounds = [(len(e.drafted), e.accepted_count) for _, events, _ in session for e in events]
    assert replayed_rounds(trace, 4) == rounds  # the run's own K: its rounds exactly
    decoder.restore_session(before)  # the same session at another K
    other = _session(decoder, GenerationConfig(method="suffix", k=k, max_new_tokens=24, stop_at_eos=False))
    assert replayed_rounds(trace, k) == [(len(e.drafted), e.accepted_count) for _, ev, _ in other for e in ev]
    assert predict_tokens_per_forward(trace, k)[1] == "exact (replayed)"
    bare = load_trace(_write(decoder, session, config, tmp_path / "bare.jsonl", fingerprints=False))
    assert bare.replay is None and predict_tokens_per_forward(bare, k)[1].startswith("per-depth model")


def test_run_trace_fingerprints_the_memory_and_predict_replays_it(tiny_pair_dirs, tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    code = main(["run", "--prompt", PROMPTS[0], "--target", str(tiny_pair_dirs[0]), "--method", "suffix",
                 "--k", "4", "--max-new-tokens", "24", "--trace", str(path)])
    assert code == 0
    header = json.loads(path.read_text().splitlines()[0])
    assert header["suffix_memory"]["documents"] == 0  # a fresh process: nothing remembered yet
    capsys.readouterr()
    assert main(["predict", "--trace", str(path), "--ks", "2,4,8"]) == 0
    assert "exact (replayed)" in capsys.readouterr().out


def test_a_history_read_back_from_traces_rebuilds_each_suffix_generations_memory(decoder, tmp_path):
    """The window's kept session and Open trace add generations through Session.add_run: a suffix
    generation's diagnosis then replays it as it did live (app.session.Generation.replay)."""
    from app.session import Session
    from engine.files.trace import read_trace

    config = GenerationConfig(method="suffix", k=4, max_new_tokens=24, stop_at_eos=False)
    session = _session(decoder, config)
    history = Session()
    for run in read_trace(_write(decoder, session, config, tmp_path / "kept.jsonl")):
        history.add_run(run, "kept.jsonl")
    for gen, (_, events, documents) in zip(history.generations, session):
        assert gen.suffix_replay == (documents, decoder.vocab_size)
        assert gen.replay()(4) == [(len(e.drafted), e.accepted_count) for e in events]
        kept_again = gen.header()["suffix_memory"]  # written again when the session is kept
        assert kept_again == memory_fingerprint(documents, decoder.vocab_size)
    alone = Session()  # the last generation without the ones before it: its memory cannot be rebuilt
    alone.add_run(read_trace(_write(decoder, session, config, tmp_path / "kept.jsonl"))[-1], "kept.jsonl")
    assert alone.generations[0].suffix_replay is None and alone.generations[0].replay() is None
