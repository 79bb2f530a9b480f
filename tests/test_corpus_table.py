"""n-gram's corpus table: what it holds, its file, and where it is not loaded."""
import shutil

import pytest
import torch
from tiny_models import make_tiny_pair

from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayWarning
from engine.methods.ngram import corpus_table
from engine.models.loading import load_pair


def test_build_keeps_the_most_frequent_continuations():
    # after 1 comes 2 (three times) more often than 3; after (4, 1) it is 3 every time
    sequences = [[1, 2, 5, 1, 2, 5, 1, 2, 5], [4, 1, 3, 6], [4, 1, 3, 6]]
    table = corpus_table.build(sequences, vocab=8, width=3, pairs=10)
    assert table.chain[1].tolist() == [2, 5, 1]  # each next token the most frequent after the last two
    assert table.chain[7].tolist() == [-1, -1, -1]  # never seen
    assert table.continuation([4, 1], 3) == [3, 6]  # the pair's row, cut at its end
    assert table.continuation([0, 1], 2) == [2, 5]  # no row for (0, 1): the last token's
    assert table.metadata["tokens"] == 17 and table.pair_keys.tolist() == sorted(table.pair_keys.tolist())


def test_the_file_round_trip_and_the_tokenizer_check(tmp_path):
    target, _ = make_tiny_pair(tmp_path / "pair")
    sha = corpus_table.tokenizer_sha256(target)
    table = corpus_table.build([[1, 2, 3, 1, 2, 4] * 5], vocab=16, pairs=4,
                               metadata={"tokenizer_sha256": sha})
    table.save(target / corpus_table.TABLE_FILE)
    loaded = corpus_table.load(target)
    assert torch.equal(loaded.chain, table.chain) and torch.equal(loaded.pair_keys, table.pair_keys)
    assert torch.equal(loaded.pair_tokens, table.pair_tokens)
    other = tmp_path / "other"
    shutil.copytree(target, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    with pytest.warns(SpecplayWarning, match="another tokenizer"):
        assert corpus_table.load(other) is None
    (other / corpus_table.TABLE_FILE).write_bytes(b"not a table")
    with pytest.warns(SpecplayWarning, match="unreadable"):
        assert corpus_table.load(other) is None


def test_a_truncated_table_is_left_out_with_a_warning(tmp_path):
    target, _ = make_tiny_pair(tmp_path / "pair")
    sha = corpus_table.tokenizer_sha256(target)
    path = target / corpus_table.TABLE_FILE
    table = corpus_table.build([[1, 2, 3] * 5], vocab=16, pairs=4, metadata={"tokenizer_sha256": sha})
    table.save(path)
    path.write_bytes(path.read_bytes()[:-9])  # cut off inside the last tensor
    with pytest.warns(SpecplayWarning, match=f"{corpus_table.TABLE_FILE}.*runs without it"):
        assert corpus_table.load(target) is None


def test_greedy_ngram_with_a_table_equals_plain_greedy(tmp_path):
    """A table that fills every slot (each token's row the next ids) changes the drafts, never the output;
    with it the drafter drafts in more rounds than without."""
    target, _ = make_tiny_pair(tmp_path / "pair")
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    vocab = decoder.vocab_size
    table = corpus_table.build([list(range(vocab)) * 3], vocab=vocab,
                               metadata={"tokenizer_sha256": corpus_table.tokenizer_sha256(target)})
    table.save(target / corpus_table.TABLE_FILE)
    prompt = "the cat sat on the mat"
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=40))
    drafted = {}
    for corpus in (False, True):
        config = GenerationConfig(method="ngram", k=4, max_new_tokens=40, ngram_corpus=corpus)
        events = list(decoder.generate(prompt, config))
        assert [t for e in events for t in e.emitted_ids] == plain
        drafted[corpus] = sum(bool(e.drafted) for e in events) / len(events)
    assert decoder.ngram_table() is not None and drafted[True] > drafted[False]


def test_the_table_is_on_by_default_on_the_gpu_only():
    """auto (None): on CUDA, where a round's rows cost the same whatever it drafts; off on the CPU."""
    auto, on, off = (GenerationConfig(method="ngram", ngram_corpus=v) for v in (None, True, False))
    assert auto.uses_ngram_table("cuda") and not auto.uses_ngram_table(torch.device("cpu"))
    assert on.uses_ngram_table("cpu") and not off.uses_ngram_table(torch.device("cuda", 0))
