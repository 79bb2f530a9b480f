"""A served engine as a source of rounds: an OpenAI-compatible completions server (llama.cpp's llama-server,
vLLM, SGLang, or any other) streamed into the RoundEvent stream, with the engine's own speculative counters.

    server = ServedEngine.connect("http://127.0.0.1:8080")          # kind detected where the server says
    generation = server.generation(ServedRequest(prompt="def f(x):", max_tokens=64, k=4))
    for event in generation:                                         # RoundEvents as the chunks arrive
        ...
    generation.result                                                # text, TTFT, TPOT, the server's counters
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from engine.analysis import analytic
from engine.sources import counters as spec
from engine.sources.http import Address, ServerError, get_json, get_text, parse_url, post_events
from engine.sources.rounds import Chunk, RoundBuilder

KINDS = ("llama.cpp", "vllm", "sglang", "openai")
COMPLETIONS = "/v1/completions"
METRICS = "/metrics"


@dataclass
class ServedRequest:
    prompt: str
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    k: Optional[int] = None  # tokens drafted a step, where the engine takes it per request (None: its own)
    speculate: bool = True  # False: drafting off for this request (llama.cpp: speculative.n_max 0)
    seed: Optional[int] = None


@dataclass
class ServedResult:
    """One served generation: what came back and the engine's counters for it."""

    text: str = ""
    tokens: int = 0
    ttft_ms: Optional[float] = None
    total_ms: float = 0.0
    finish: Optional[str] = None
    counters: Optional[spec.SpecCounters] = None  # this request's (None: the engine gives none)
    k: Optional[int] = None
    rounds: list = field(default_factory=list)

    @property
    def tpot_ms(self) -> Optional[float]:
        """Time per output token after the first (the serving definition)."""
        if self.ttft_ms is None or self.tokens < 2:
            return None
        return (self.total_ms - self.ttft_ms) / (self.tokens - 1)

    @property
    def tokens_per_s(self) -> Optional[float]:
        return 1000.0 * self.tokens / self.total_ms if self.total_ms > 0 else None

    def figures(self) -> dict:
        """α, tokens a verification step, its analytic E, per-position acceptance, TTFT, TPOT, tokens/s
        (None for what the server did not give)."""
        c = self.counters
        alpha = c.acceptance_rate if c else None
        per_step = (1.0 + c.accepted / c.drafts) if c and c.drafts and c.accepted is not None \
            else (c.accept_length if c else None)
        k = self.k or max((len(e.drafted) for e in self.rounds), default=0) or None  # the server's own K
        analytic_e = analytic.expected_tokens(alpha, k) if alpha is not None and k else None
        return {"tokens": self.tokens, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "tokens_per_s": self.tokens_per_s, "alpha": alpha, "k": k,
                "drafts": c.drafts if c else None, "draft_tokens": c.draft_tokens if c else None,
                "accepted": c.accepted if c else None, "tokens_per_step": per_step,
                "analytic_tokens_per_step": analytic_e,
                "per_position_acceptance": (c.per_position_acceptance() if c else [])[:k or None],
                "accepted_per_position": (list(c.accepted_per_position) if c else [])[:k or None],
                "finish": self.finish}


class ServedEngine:
    def __init__(self, address: Address, kind: str, read_timeout_s: float = 60.0):
        if kind not in KINDS:
            raise ServerError(f"unknown server kind {kind!r} (choose from {', '.join(KINDS)})")
        self.address, self.kind, self.read_timeout_s = address, kind, read_timeout_s
        self.model: Optional[str] = None
        # llama.cpp builds that compile in the per-request speculative fields list speculative.n_max in
        # /props; newer ones take K (--spec-draft-n-max) and the method (--spec-type) at their start only
        self.per_request_k = False

    @classmethod
    def connect(cls, url: str, kind: Optional[str] = None, read_timeout_s: float = 60.0) -> "ServedEngine":
        """Parse the URL and detect the kind where the server says (raises ServerError when it cannot be
        reached)."""
        address = parse_url(url)
        engine = cls(address, kind or detect_kind(address), read_timeout_s)
        if engine.kind == "llama.cpp":
            engine.read_props()
        return engine

    def read_props(self) -> None:
        """llama.cpp's /props: whether it takes speculative.n_max per request (its speculative.types there is
        the per-request default, not what the server runs with: not read)."""
        props = get_json(self.address, "/props", min(10.0, self.read_timeout_s)) or {}
        settings = props.get("default_generation_settings")
        params = settings.get("params", settings) if isinstance(settings, dict) else {}
        params = params if isinstance(params, dict) else {}
        self.per_request_k = "speculative.n_max" in params

    @property
    def label(self) -> str:
        return f"{self.kind} {self.address.label}"

    # ------------------------------------------------------------------------------------------- counters
    def scrape(self) -> Optional[spec.SpecCounters]:
        """The engine's cumulative speculative counters from its metrics endpoint (None for engines that
        publish them per request). A missing or malformed endpoint is a ServerError."""
        if self.kind not in ("llama.cpp", "vllm"):
            return None
        status, text = get_text(self.address, METRICS, min(10.0, self.read_timeout_s))
        if status != 200:
            hint = " (start llama-server with --metrics)" if self.kind == "llama.cpp" else ""
            raise ServerError(f"{self.address.label}{METRICS} answered HTTP {status}: no metrics{hint}")
        try:
            return spec.llamacpp_metrics(text) if self.kind == "llama.cpp" else spec.vllm_metrics(text)
        except spec.MetricsFormatError as exc:
            raise ServerError(f"{self.address.label}{METRICS}: {exc}") from None

    # ------------------------------------------------------------------------------------------- requests
    def body(self, request: ServedRequest) -> dict:
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
                "temperature": request.temperature}
        if self.model:
            body["model"] = self.model
        if request.seed is not None:
            body["seed"] = request.seed
        if self.kind == "llama.cpp":
            body.update({"timings_per_token": True, "cache_prompt": False})
            if not request.speculate:
                body.update({"speculative.n_max": 0, "speculative.n_min": 0})
            elif request.k is not None:
                body.update({"speculative.n_max": request.k, "speculative.n_min": request.k})
        elif self.kind in ("vllm", "sglang", "openai"):
            body["logprobs"] = 1  # the tokens of each chunk, to count them
            if self.kind == "sglang":
                body["return_meta_info"] = True
        return body

    def generation(self, request: ServedRequest, scrape: bool = True) -> "ServedGeneration":
        if not request.speculate and not self.per_request_k:
            raise ServerError(f"{self.label} cannot turn drafting off per request: give a second URL for the "
                              "plain server (--plain-server)")
        if request.k is not None and request.speculate and not self.per_request_k:
            raise ServerError(f"{self.label} takes K at its start, not per request: restart it with another "
                              "K (llama-server: --spec-draft-n-max K), one K at a time")
        return ServedGeneration(self, request, scrape)


class ServedGeneration:
    """Iterate for RoundEvents as the stream arrives; `result` fills in as it goes (the rounds received so
    far are kept when the stream fails: `result.rounds`)."""

    def __init__(self, engine: ServedEngine, request: ServedRequest, scrape: bool):
        self.engine, self.request, self.scrape = engine, request, scrape
        k = request.k if request.speculate else 0
        self.method = "draft" if request.speculate else "none"
        self.result = ServedResult(k=k or None)
        self.builder = RoundBuilder(self.method, k or 0, engine.label)

    def __iter__(self) -> Iterator:
        try:
            yield from self._stream()
        except ServerError:  # the rounds received so far are kept: the open one closes as an error
            for event in self.builder.finish("error"):
                self.result.rounds.append(event)
                yield event
            raise

    def _stream(self) -> Iterator:
        engine = self.engine
        before = engine.scrape() if self.scrape else None
        start = time.perf_counter()
        last_payload: dict = {}
        for arrived, payload in post_events(engine.address, COMPLETIONS, engine.body(self.request),
                                            engine.read_timeout_s):
            chunk = self._chunk(payload, 1000.0 * (arrived - start))
            last_payload = payload
            if chunk is None:
                continue
            for event in self.builder.add(chunk):
                self.result.rounds.append(event)
                yield event
            if chunk.finish:
                self.result.finish = chunk.finish
        for event in self.builder.finish(self.result.finish or "stopped"):
            self.result.rounds.append(event)
            yield event
        self.result.counters = self._counters(last_payload, before)

    def _chunk(self, payload: dict, at_ms: float) -> Optional[Chunk]:
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            if "timings" in payload or "usage" in payload:
                return None  # a closing chunk of figures only
            raise ServerError(f"{self.engine.address.label}{COMPLETIONS} streamed a chunk without choices: "
                              "not an OpenAI completions stream")
        choice = choices[0]
        text = choice.get("text")
        if not isinstance(text, str):
            text = ""
        finish = _finish(choice.get("finish_reason"))
        timings = spec.llamacpp_timings(payload) if self.engine.kind == "llama.cpp" else None
        tokens = self._tokens_in(choice, timings)
        if tokens == 0 and not finish:
            return None
        if self.result.ttft_ms is None and tokens:
            self.result.ttft_ms = at_ms
        self.result.text += text
        self.result.tokens += tokens
        self.result.total_ms = at_ms
        return Chunk(at_ms=at_ms, text=text, tokens=tokens, finish=finish,
                     draft_n=timings.draft_n if timings else None,
                     draft_accepted=timings.draft_n_accepted if timings else None)

    def _tokens_in(self, choice: dict, timings) -> int:
        """Tokens a chunk holds: llama.cpp's running predicted_n, else the chunk's logprobs tokens, else one
        a chunk with text."""
        if timings is not None and timings.predicted_n is not None:
            return max(0, timings.predicted_n - self.result.tokens)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
            return len(logprobs["tokens"])
        return 1 if choice.get("text") else 0

    def _counters(self, last: dict, before: Optional[spec.SpecCounters]) -> Optional[spec.SpecCounters]:
        engine = self.engine
        if engine.kind == "sglang":
            return spec.sglang_counters(last)
        after = engine.scrape() if before is not None else None
        scraped = after.minus(before) if after is not None else None
        timings = spec.llamacpp_timings(last) if engine.kind == "llama.cpp" else None
        if timings is not None and scraped is not None:  # the response's own counts of this request
            scraped.draft_tokens, scraped.accepted = timings.draft_n, timings.draft_n_accepted
            return scraped
        if timings is not None:
            return spec.SpecCounters(draft_tokens=timings.draft_n, accepted=timings.draft_n_accepted)
        return scraped


def _finish(reason) -> Optional[str]:
    """An OpenAI finish_reason as the playground's: stop -> eos, length -> length."""
    if not reason:
        return None
    return {"stop": "eos", "length": "length"}.get(str(reason), "eos")


def detect_kind(address: Address) -> str:
    """llama.cpp answers /props (with its build info) or /health, vLLM /version, SGLang /get_server_info;
    anything else is a plain OpenAI-compatible server. An unreachable server raises ServerError."""
    props = get_json(address, "/props", 5.0)
    if props is not None and ("build_info" in props or "default_generation_settings" in props):
        return "llama.cpp"
    info = get_json(address, "/get_server_info", 5.0)
    if info is not None and ("speculative_algorithm" in info or "tp_size" in info or "model_path" in info):
        return "sglang"
    version = get_json(address, "/version", 5.0)
    if version is not None and "version" in version:
        return "vllm"
    return "openai"


class ServedDecoder:
    """The local decoder's generate() over a served engine, so the window's job / worker path runs it as it
    runs the local engine: the menus' method none turns drafting off, K goes per request where the engine
    takes it (llama.cpp), the other settings (temperature, seed, max new tokens) go with every request."""

    def __init__(self, engine: ServedEngine):
        self.engine = engine

    @property
    def device_name(self) -> str:
        return self.engine.label

    def request(self, prompt: str, config) -> ServedRequest:
        speculate = config.method != "none"
        k = config.k if speculate and self.engine.per_request_k else None
        return ServedRequest(prompt=prompt, max_tokens=config.max_new_tokens,
                             temperature=config.sampling.temperature, k=k, speculate=speculate,
                             seed=config.seed)

    def generate(self, prompt: str, config, should_stop=lambda: False) -> Iterator:
        """RoundEvents as they arrive; stopping closes the stream (and its connection)."""
        generation = self.engine.generation(self.request(prompt, config))
        iterator = iter(generation)
        try:
            for event in iterator:
                yield event
                if should_stop():
                    return
        finally:
            iterator.close()
