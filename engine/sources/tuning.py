"""The tuning loop against a served engine: on/off, a K sweep, concurrent clients (the batch regime) and the
output-equality check. Each row is a plain dict of measured figures (None where the server gives none)."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable, Optional

from engine.sources.http import ServerError
from engine.sources.server import ServedEngine, ServedRequest, ServedResult


def served_once(engine: ServedEngine, request: ServedRequest, scrape: bool = True) -> ServedResult:
    """One generation to its end (its rounds drained): the result with the engine's counters."""
    generation = engine.generation(request, scrape)
    for _ in generation:
        pass
    return generation.result


class Arms:
    """Speculation on and off: the same server with drafting off per request (llama.cpp), or a second plain
    server."""

    def __init__(self, engine: ServedEngine, plain: Optional[ServedEngine] = None):
        if plain is None and not engine.per_request_k:
            raise ServerError(f"{engine.label} cannot turn drafting off per request: give the plain "
                              "server's URL too (--plain-server)")
        self.engine, self.plain = engine, plain

    def on(self, request: ServedRequest) -> tuple:
        return self.engine, replace(request, speculate=True)

    def off(self, request: ServedRequest) -> tuple:
        if self.plain is not None:
            return self.plain, replace(request, speculate=True, k=None)
        return self.engine, replace(request, speculate=False, k=None)


def on_off(arms: Arms, request: ServedRequest) -> dict:
    """Speculation on and off on one prompt: both rows' figures and the measured speedup (tokens/s)."""
    on = served_once(*arms.on(request))
    off = served_once(*arms.off(request), scrape=False)
    return {"on": on.figures(), "off": off.figures(), "speedup": _ratio(on.tokens_per_s, off.tokens_per_s),
            "tpot_ratio": _ratio(off.tpot_ms, on.tpot_ms), "equal": on.text == off.text}


def k_sweep(arms: Arms, request: ServedRequest, ks: list, going: Callable = lambda: True) -> list:
    """A row per K (the engine takes K per request: llama.cpp) beside one plain run of the prompt."""
    if not arms.engine.per_request_k:
        raise ServerError(f"{arms.engine.label} takes K at its start: sweep K by restarting it with each K "
                          "(llama-server: --spec-draft-n-max K) and measuring one at a time")
    plain = served_once(*arms.off(request), scrape=False)
    rows = []
    for k in ks:
        if not going():
            break
        result = served_once(*arms.on(replace(request, k=k)))
        row = dict(result.figures(), k=k, speedup=_ratio(result.tokens_per_s, plain.tokens_per_s),
                   equal=result.text == plain.text)
        rows.append(row)
    return rows


def concurrent(engine: ServedEngine, request: ServedRequest, clients: int) -> dict:
    """`clients` requests at once (threads), timed together: total tokens over the wall time, and the
    engine's counters over the whole batch (scraped before and after it)."""
    before = engine.scrape()
    results: list = [None] * clients
    errors: list = []

    def one(index: int) -> None:
        try:
            results[index] = served_once(engine, request, scrape=False)
        except ServerError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_ms = 1000.0 * (time.perf_counter() - start)
    if errors:
        raise errors[0]
    after = engine.scrape()
    counters = after.minus(before) if after is not None and before is not None else None
    tokens = sum(r.tokens for r in results)
    return {"clients": clients, "tokens": tokens, "wall_ms": wall_ms,
            "tokens_per_s": 1000.0 * tokens / wall_ms if wall_ms > 0 else None,
            "alpha": counters.acceptance_rate if counters else None,
            "texts_equal": len({r.text for r in results}) == 1, "texts": [r.text for r in results]}


def client_sweep(arms: Arms, request: ServedRequest, counts: list, going: Callable = lambda: True) -> list:
    """The served gain against concurrency: for each N, N clients with speculation on, then off."""
    rows = []
    for clients in counts:
        if not going():
            break
        on = concurrent(*arms.on(request), clients)
        off = concurrent(*arms.off(request), clients)
        rows.append({"clients": clients, "on_tokens_per_s": on["tokens_per_s"],
                     "off_tokens_per_s": off["tokens_per_s"], "alpha": on["alpha"],
                     "speedup": _ratio(on["tokens_per_s"], off["tokens_per_s"]),
                     "equal": on["texts_equal"] and off["texts_equal"] and on["texts"][0] == off["texts"][0]})
    return rows


def check_equal(arms: Arms, request: ServedRequest) -> dict:
    """Greedy text with speculation on against off: equal, or the first character where they part."""
    greedy = replace(request, temperature=0.0)
    on = served_once(*arms.on(greedy), scrape=False)
    off = served_once(*arms.off(greedy), scrape=False)
    diverge = next((i for i, (a, b) in enumerate(zip(on.text, off.text)) if a != b),
                   None if len(on.text) == len(off.text) else min(len(on.text), len(off.text)))
    return {"equal": on.text == off.text, "diverges_at": diverge, "on_text": on.text, "off_text": off.text,
            "tokens": on.tokens}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None
