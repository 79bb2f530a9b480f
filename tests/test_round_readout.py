"""The host's unpacking of a round's flat readout (engine.core.decoder._RoundReadout.unpack), against the
layout
the readout kernels write: accepted, next token, then path, draft tokens, p, q, accept_prob, tested [N each],
next_p [N+1], top_p and top_i [(N+1) * W each], and a chain's count of real drafts after them."""
import random

import pytest

from engine.core.decoder import _RoundReadout
from engine.errors import SpecplayError


def _flat(fields: dict, n: int, width: int) -> list:
    values = [float(fields["accepted"]), float(fields["next_token"])]
    values += [float(i) for i in fields["path"]] + [0.0] * (n - len(fields["path"]))
    for name in ("draft_tokens", "p", "q", "accept_prob", "tested", "next_p"):
        values += [float(v) for v in fields[name]]
    for name in ("top_p", "top_i"):
        values += [float(v) for row in fields[name] for v in row]
    return values


def _fields(rng: random.Random, n: int, width: int, accepted: int) -> dict:
    rows = n + 1
    return {"accepted": accepted, "next_token": rng.randrange(50000), "path": list(range(accepted)),
            "draft_tokens": [rng.randrange(50000) for _ in range(n)],
            "p": [rng.random() for _ in range(n)], "q": [rng.random() for _ in range(n)],
            "accept_prob": [rng.random() for _ in range(n)],
            "tested": [float(rng.random() < 0.5) for _ in range(n)],
            "next_p": [rng.random() for _ in range(rows)],
            "top_p": [[rng.random() for _ in range(width)] for _ in range(rows)],
            "top_i": [[rng.randrange(50000) for _ in range(width)] for _ in range(rows)]}


@pytest.mark.parametrize("n,width", [(0, 1), (1, 5), (4, 5), (8, 3), (16, 5)])
def test_unpack_reads_every_field_where_the_readout_wrote_it(n, width):
    rng = random.Random(n * 31 + width)
    for accepted in range(n + 1):
        fields = _fields(rng, n, width, accepted)
        got = _RoundReadout.unpack(_flat(fields, n, width), n, width)
        assert got.path == fields["path"] and got.next_token == fields["next_token"]
        assert got.draft_tokens == fields["draft_tokens"]
        assert (got.p, got.q, got.accept_prob, got.tested) == tuple(
            fields[k] for k in ("p", "q", "accept_prob", "tested"))
        assert got.next_p == fields["next_p"][accepted]  # the row after the accepted path
        assert got.top_p == fields["top_p"] and got.top_i == fields["top_i"]
        assert all(type(t) is int for t in got.draft_tokens + got.path + [i for r in got.top_i for i in r])


def test_unpack_keeps_a_chains_real_drafts_only():
    rng = random.Random(7)
    n, width = 8, 5
    for count in range(n + 1):
        fields = _fields(rng, n, width, rng.randint(0, count))
        values = _flat(fields, n, width) + [float(count)]  # the count travels after the values
        got = _RoundReadout.unpack(values, n, width, keep=count)
        assert got.draft_tokens == fields["draft_tokens"][:count]
        assert got.p == fields["p"][:count] and got.tested == fields["tested"][:count]
        assert got.top_p == fields["top_p"][:count + 1] and got.top_i == fields["top_i"][:count + 1]
        assert got.path == fields["path"] and got.next_p == fields["next_p"][len(fields["path"])]


@pytest.mark.parametrize("flagged", [(-1.0, 5.0), (2.0, -1.0)])
def test_unpack_refuses_a_round_the_kernels_flagged_as_nan(flagged):
    fields = _fields(random.Random(1), 4, 5, 2)
    values = _flat(fields, 4, 5)
    values[:2] = flagged
    with pytest.raises(SpecplayError, match="NaN"):
        _RoundReadout.unpack(values, 4, 5)
