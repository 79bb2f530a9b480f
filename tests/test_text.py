"""Incremental detokenization gives exactly the text of a full decode, however the tokens arrive."""
import random

import pytest
from transformers import AutoTokenizer

from engine.core.text import IncrementalText, fast_decoder_of
from engine.models.loading import shipped_pair


def full_decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def shipped_tokenizer():
    target, _ = shipped_pair()
    return AutoTokenizer.from_pretrained(str(target))


def chunked(ids, rng):
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 6)
        chunks.append(ids[i:i + size])
        i += size
    return chunks


def pieces(tokenizer, chunks):
    text = IncrementalText(tokenizer)
    return [text.add(chunk, final=index == len(chunks) - 1) for index, chunk in enumerate(chunks)]


@pytest.mark.parametrize("seed", range(5))
def test_code_in_random_chunks(shipped_tokenizer, seed):
    source = 'def greet(name):\n    """Say hello — ünïcödé 🐍."""\n\treturn f"hi {name}"\n' * 3
    ids = shipped_tokenizer.encode(source)
    got = pieces(shipped_tokenizer, chunked(ids, random.Random(seed)))
    assert "".join(got) == full_decode(shipped_tokenizer, ids) == source


@pytest.mark.parametrize("seed", range(5))
def test_random_ids_split_multibyte_characters(shipped_tokenizer, seed):
    """Random ids include byte tokens that end mid-character; held-back text must come out later, once."""
    rng = random.Random(seed)
    ids = [rng.randrange(shipped_tokenizer.vocab_size) for _ in range(300)]
    got = pieces(shipped_tokenizer, chunked(ids, rng))
    assert "".join(got) == full_decode(shipped_tokenizer, ids)


def test_an_incomplete_character_is_held_back(shipped_tokenizer):
    ids = shipped_tokenizer.encode("🐍")
    if len(ids) < 2:
        pytest.skip("the snake is one token in this vocabulary")
    text = IncrementalText(shipped_tokenizer)
    assert text.add(ids[:1]) == ""
    assert text.add(ids[1:], final=True) == "🐍"


def test_the_fast_decoder_is_the_tokenizers_decode(shipped_tokenizer):
    """The Rust tokenizer's decode (what IncrementalText uses) gives transformers' text on random id lists,
    special tokens among them; a tokenizer without one, or whose text differs, keeps transformers' decode."""
    decode = fast_decoder_of(shipped_tokenizer)
    assert decode.__name__ == "fast"
    rng = random.Random(7)
    specials = list(shipped_tokenizer.all_special_ids)
    for _ in range(400):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(shipped_tokenizer.vocab_size)
               for _ in range(rng.randint(0, 20))]
        assert decode(ids) == full_decode(shipped_tokenizer, ids)

    class Wrapped:  # a tokenizer whose decode differs from its backend's: the probe lists catch it
        backend_tokenizer = shipped_tokenizer.backend_tokenizer
        vocab_size = shipped_tokenizer.vocab_size

        def decode(self, ids, **_):
            return "|".join(str(i) for i in ids)

    assert fast_decoder_of(Wrapped()).__name__ == "slow"
