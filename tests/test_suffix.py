"""Suffix decoding: the index, the draft tree, the session memory, losslessness (greedy and chi-squared)."""
import pytest
from spec_fixtures import target_only_decoder
from tiny_models import make_tiny_llama

from engine.analysis.lossless import check_sampling
from engine.cli.main import main
from engine.config import GenerationConfig, SamplingParams
from engine.core.metrics import final_metrics
from engine.errors import SpecplayError
from engine.methods.suffix.drafter import MAX_MATCH, SuffixIndex, SuffixMemory, best_tree

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture
def decoder(tiny_pair_dirs):
    """A fresh decoder over the tiny pair's target (conftest.py) alone: a fresh session memory."""
    return target_only_decoder(tiny_pair_dirs[0])


def suffix(**kw) -> GenerationConfig:
    return GenerationConfig(method="suffix", **kw)


def test_index_finds_the_longest_match_and_its_occurrences():
    index = SuffixIndex()
    index.extend([1, 2, 3, 4, 9, 2, 3, 5])
    index.end_document()
    index.extend([7, 3, 6])
    found = dict(index.occurrences([0, 2, 3]))  # occurrences of (2, 3) first: positions 2 and 6
    assert found == {2: 2, 6: 2}
    assert index.continuation(2, 3, vocab=100) == [4, 9, 2]
    assert index.continuation(6, 3, vocab=100) == [5]  # cut at the document's end
    assert index.continuation(2, 3, vocab=5) == [4]  # cut at a token outside the vocabulary
    assert dict(index.occurrences([8, 3])) == {2: 1, 6: 1, 10: 1}  # no (8, 3) anywhere: the last token alone
    assert index.occurrences([42]) == []


def test_index_match_length_is_capped_and_stops_at_documents():
    index = SuffixIndex()
    index.extend([5] * (MAX_MATCH + 10))
    assert max(n for _, n in index.occurrences([5] * (MAX_MATCH + 10))) == MAX_MATCH
    index = SuffixIndex()
    index.extend([1, 2])
    index.end_document()
    index.extend([2, 3])
    # [1, 2] ends the first document (nothing follows it): the 2 of the second document, matched alone
    assert dict(index.occurrences([1, 2])) == {3: 1}


def test_best_tree_is_topological_probable_first_and_within_budget():
    sequences = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 5], [6]]
    tokens, parents, score = best_tree(sequences, budget=10, min_prob=0.0)
    assert all(p < i for i, p in enumerate(parents))
    assert tokens[:2] == [1, 2] and parents[:2] == [-1, 0]  # 4/5, then 4/5 * 3/4
    siblings = {}
    for token, parent in zip(tokens, parents, strict=True):
        siblings.setdefault(parent, []).append(token)
    assert all(len(s) == len(set(s)) for s in siblings.values())
    assert score == pytest.approx(0.8 + 0.6 + 0.4 + 0.2 + 0.2 + 0.2)
    small = best_tree(sequences, budget=3, min_prob=0.0)
    assert small[0] == [1, 2, 3] and small[2] == pytest.approx(0.8 + 0.6 + 0.4)
    pruned = best_tree(sequences, budget=10, min_prob=0.5)
    assert pruned[0] == [1, 2] and pruned[1] == [-1, 0]
    assert best_tree([], budget=4) == ([], [], 0.0)


@pytest.mark.parametrize("k, nodes", [(1, 0), (2, 0), (4, 0), (4, 3), (6, 16)])
def test_greedy_equals_plain(decoder, k, nodes):
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48))
    for _ in range(2):  # the second generation drafts from the session memory too
        assert decoder.generate_ids(PROMPT, suffix(k=k, tree_nodes=nodes, max_new_tokens=48)) == plain


def test_rounds_are_trees_within_the_budget_and_depth(decoder):
    decoder.generate_ids(PROMPT, suffix(max_new_tokens=40))  # something to remember
    for k, nodes in ((3, 5), (4, 0)):
        budget = nodes or 2 * k
        events = list(decoder.generate("the cat sat on", suffix(k=k, tree_nodes=nodes, max_new_tokens=40)))
        assert any(len(e.drafted) > 0 for e in events)
        for e in events:
            assert len(e.drafted) <= budget
            assert all(t.depth < k for t in e.drafted)
            assert all(t.q == pytest.approx(1.0) for t in e.drafted)  # one-hot drafts
            accepted = sorted((t for t in e.drafted if t.accepted), key=lambda t: t.depth)
            assert [t.depth for t in accepted] == list(range(e.accepted_count))


def test_a_repeated_task_drafts_from_the_session(decoder):
    """A second generation of the same prompt finds the first one's output in the session memory."""
    config = suffix(k=4, max_new_tokens=64, stop_at_eos=False)
    first = final_metrics(list(decoder.generate(PROMPT, config)))
    second = final_metrics(list(decoder.generate(PROMPT, config)))
    assert decoder.suffix_memory().documents == 1  # the first generation (the second is still open)
    assert second.tokens_per_forward >= 3.0, (first.tokens_per_forward, second.tokens_per_forward)
    assert second.tokens_per_forward > first.tokens_per_forward


def test_a_corpus_file_is_remembered(decoder, tiny_pair_dirs, tmp_path):
    config = suffix(k=4, max_new_tokens=48, stop_at_eos=False)
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=48,
                                                          stop_at_eos=False))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PROMPT + decoder.tokenizer.decode(plain), encoding="utf-8")
    fresh = target_only_decoder(tiny_pair_dirs[0])
    metrics = final_metrics(list(fresh.generate(PROMPT, GenerationConfig(
        method="suffix", k=4, max_new_tokens=48, stop_at_eos=False, suffix_corpus=str(corpus)))))
    assert metrics.tokens_per_forward >= 3.0
    assert fresh.generate_ids(PROMPT, config) == plain


def test_memory_is_bounded_and_clears():
    memory = SuffixMemory(max_tokens=100)
    for i in range(50):
        memory.add([i % 7] * 9)
    assert len(memory.index) <= 100
    assert memory.documents < 50
    memory.begin([1, 2, 3])
    memory.finish()
    assert memory.index.tokens[-4:] == [1, 2, 3, -1]
    memory.clear()
    assert len(memory.index) == 0 and memory.documents == 0


def index_state(index: SuffixIndex) -> tuple:
    return list(index.tokens), {k: list(v) for k, v in index._ends1.items()}, \
        {k: list(v) for k, v in index._ends2.items()}


@pytest.mark.parametrize("evicted", [False, True])
def test_a_checkpoint_restores_the_memory_exactly(evicted):
    """What generations add after checkpoint() is forgotten by restore(): the index cut back (or rebuilt,
    where the budget evicted documents meanwhile) to what a memory that never saw them holds."""
    def session(memory):
        memory.add([5, 6, 7, 5, 6])
        memory.begin([1, 2, 3, 1, 2])  # the session's last generation, still open
        return memory

    memory, untouched = session(SuffixMemory(max_tokens=40)), session(SuffixMemory(max_tokens=40))
    saved = memory.checkpoint()
    for i in range(12 if evicted else 2):  # measurement runs
        memory.begin([9, i, 9, i, 5, 6])
    memory.finish()
    assert (memory.index is not saved[3]) == evicted  # an eviction rebuilt the index; else it grew in place
    assert evicted or memory.documents == 4  # the session's two, then the two measurement runs
    memory.restore(saved)
    for m in (memory, untouched):
        m.begin([4, 4])  # the next generation indexes the open one
    assert index_state(memory.index) == index_state(untouched.index)
    assert memory.documents == untouched.documents == 2


def test_measurement_runs_leave_the_session_as_they_found_it(decoder, tiny_pair_dirs):
    """Calibration, a K sweep, a method sweep and the lossless check decode the prompt many times; none of
    it may become the session's memory, and no K or repeat of a sweep may recall another's output."""
    from dataclasses import replace

    from engine.analysis.lossless import check_greedy
    from engine.bench.suite import bench_k_sweep, bench_methods

    config = suffix(k=4, max_new_tokens=24, stop_at_eos=False)
    own = "the mat. the cat sat"  # the user's own generation, the session's memory
    decoder.generate_ids(own, config)
    documents, open_document, _, _, length = decoder.session_state()
    decoder.calibrate(4, repeats=1)
    check_greedy(decoder, PROMPT, config)
    methods = bench_methods(decoder, [PROMPT], config, ["suffix"], repeats=2)
    rows = bench_k_sweep(decoder, [PROMPT], config, (2, 8), repeats=2)
    memory = decoder.suffix_memory()
    assert memory.documents == len(documents) and memory._open is open_document
    assert len(memory.index) == length

    def next_generation(k: int) -> float:
        """Tokens per forward of PROMPT as the session's next generation (a decoder that saw only `own`)."""
        fresh = target_only_decoder(tiny_pair_dirs[0])
        fresh.generate_ids(own, config)
        return final_metrics(list(fresh.generate(PROMPT, replace(config, k=k)))).tokens_per_forward

    suffix_row = next(row for row in methods if row["method"] == "suffix")
    assert suffix_row["tokens_per_forward"] == pytest.approx(next_generation(4))  # both repeats alike
    swept = [row["tokens_per_forward"] for row in rows]
    assert swept == pytest.approx([next_generation(2), next_generation(8)])


def test_a_replay_gives_the_rounds_of_a_real_run_at_every_k(decoder):
    """Greedy suffix decoding is a function of the session's index and the context: replayed from the
    documents the index held when the generation began, its rounds are the real ones, at the run's K and at
    any other."""
    from dataclasses import replace

    from engine.methods.registry import METHODS
    from engine.methods.suffix.drafter import replay

    config = suffix(k=4, max_new_tokens=40, stop_at_eos=False)
    decoder.generate_ids("the mat. the cat sat", config)  # the session remembers one generation
    before = decoder.session_state()
    ids = decoder.prompt_ids(PROMPT)
    for k in (4, 2, 8):
        decoder.restore_session(before)
        run = replace(config, k=k)
        events = list(decoder.generate(PROMPT, run))
        documents = decoder.suffix_memory().begun_with
        assert documents and len(documents) == 1  # the earlier generation, indexed when this one began
        output = [t for e in events for t in e.emitted_ids]
        nodes = METHODS["suffix"].tree_nodes_for(run)
        replayed = replay(documents, ids, output, k, nodes, decoder.vocab_size)
        assert replayed == [(len(e.drafted), e.accepted_count) for e in events], k


def test_a_k_sweep_of_suffix_predicts_every_k_exactly_from_its_largest_k_run(decoder):
    from engine.bench.suite import bench_k_sweep

    decoder.generate_ids("the mat. the cat sat", suffix(k=4, max_new_tokens=24))  # the session so far
    rows = bench_k_sweep(decoder, [PROMPT, "on the mat the cat"], suffix(k=4, max_new_tokens=30), (1, 2, 4),
                         repeats=2)
    for row in rows:
        assert row["from_run_k"] == 4 and row["from_run_basis"] == "exact (replayed)"
        assert row["from_run_tokens_per_forward"] == pytest.approx(row["tokens_per_forward"])


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


def test_a_corpus_stays_while_generations_are_forgotten(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x" * 500, encoding="utf-8")
    memory = SuffixMemory(max_tokens=100)
    memory.load_corpus(str(corpus), CharTokenizer())
    assert len(memory.index) == 50  # half the budget: 49 tokens and the separator
    for i in range(30):
        memory.add([i] * 9)
    assert len(memory.index) <= 100 and memory.index.tokens[:49] == [ord("x")] * 49
    memory.load_corpus(str(corpus), CharTokenizer())  # once per session
    assert memory.index.tokens.count(ord("x")) == 49


def test_a_missing_corpus_is_a_clean_error(tiny_pair_dirs, tmp_path, capsys):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(SpecplayError, match="no such file"):
        GenerationConfig(method="suffix", suffix_corpus=missing).validate()
    code = main(["run", "--prompt", PROMPT, "--target", str(tiny_pair_dirs[0]), "--method", "suffix",
                 "--suffix-corpus", missing, "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: suffix corpus") and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
def test_sampling_is_lossless(tmp_path_factory):
    root = tmp_path_factory.mktemp("chi_suffix")
    target = make_tiny_llama(root / "target", vocab=24, hidden=32, layers=1, seed=11, std=0.3)
    decoder = target_only_decoder(target)
    config = suffix(k=3, sampling=SamplingParams(0.8, 0, 0.9), seed=500)
    report = check_sampling(decoder, "a tea at the tea at", config, samples=800)
    assert report.bins >= 8 and report.passed, report
