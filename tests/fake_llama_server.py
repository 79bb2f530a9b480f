"""A small fake of llama.cpp's llama-server on 127.0.0.1 (port 0, a thread) for the served-engine tests: its
streaming /v1/completions with per-token timings, /props, /health, /metrics (Prometheus, as its
server-task.cpp writes it) and the failure modes a real server can show (mode)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = [f" w{i}" for i in range(200)]
# accepted drafts of each verification step, cycled (each capped by K): a known pattern the tests count
PATTERN = [2, 0, 4, 1, 3, 0, 0, 2]


class FakeState:
    def __init__(self, mode: str = "ok", default_k: int = 4):
        self.mode = mode  # ok | cut | slow | html | no-metrics | bad-metrics | not-sse | fixed-k (K at start)
        self.default_k = default_k
        self.lock = threading.Lock()
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * 16
        self.requests: list = []
        self.steps: list = []  # (drafted, accepted) of every verification step served

    def plan(self, max_tokens: int, k: int) -> list:
        """The steps of one generation: (drafted, accepted, tokens) — the first token is the prefill's."""
        steps, made, i = [(0, 0, 1)], 1, 0
        while made < max_tokens:
            if k == 0:
                steps.append((0, 0, 1))
                made += 1
                continue
            accepted = min(PATTERN[i % len(PATTERN)], k, max_tokens - made - 1)
            steps.append((k, accepted, accepted + 1))
            made += accepted + 1
            i += 1
        return steps

    def count(self, drafted: int, accepted: int) -> None:
        with self.lock:
            if drafted:
                self.drafts += 1
                self.draft_tokens += drafted
                self.accepted += accepted
                for pos in range(accepted):
                    self.per_pos[pos] += 1
                self.steps.append((drafted, accepted))

    def metrics_text(self) -> str:
        with self.lock:
            lines = []
            for name, value in (("prompt_tokens_total", 10), ("tokens_predicted_total", 0),
                                ("spec_decode_num_draft_tokens_total", self.draft_tokens),
                                ("spec_decode_num_accepted_tokens_total", self.accepted),
                                ("spec_decode_num_drafts_total", self.drafts)):
                lines += [f"# HELP llamacpp:{name} a counter", f"# TYPE llamacpp:{name} counter",
                          f"llamacpp:{name} {value}"]
            lines += ["# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per "
                      "draft position",
                      "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter"]
            used = max((i + 1 for i, v in enumerate(self.per_pos) if v), default=0)
            lines += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} '
                      f"{self.per_pos[i]}" for i in range(max(used, 1))]
            return "\n".join(lines) + "\n"


def make_handler(state: FakeState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: str, kind: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if state.mode == "html":
                return self._send(200, "<html>hello</html>", "text/html")
            if self.path == "/props":
                params = {"speculative.types": "draft-simple" if state.default_k else "none"}
                if state.mode != "fixed-k":  # older llama-server builds take K per request and list it
                    params.update({"speculative.n_max": state.default_k, "speculative.n_min": 0})
                return self._send(200, json.dumps({"build_info": "fake",
                                                   "default_generation_settings": {"params": params}}))
            if self.path == "/health":
                return self._send(200, json.dumps({"status": "ok"}))
            if self.path == "/metrics":
                if state.mode == "no-metrics":
                    return self._send(501, json.dumps({"error": {"message": "metrics disabled"}}))
                if state.mode == "bad-metrics":
                    return self._send(200, "this is { not prometheus\n", "text/plain")
                return self._send(200, state.metrics_text(), "text/plain; version=0.0.4")
            return self._send(404, json.dumps({"error": {"message": "not found"}}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            state.requests.append(body)
            if state.mode == "html":
                return self._send(200, "<html>not an API</html>", "text/html")
            if state.mode == "not-sse":
                return self._send(200, json.dumps({"choices": [{"text": "x"}]}))
            if self.path != "/v1/completions":
                return self._send(404, json.dumps({"error": {"message": "not found"}}))
            k = state.default_k
            if state.mode != "fixed-k":
                k = int(body.get("speculative.n_max", k))
            self._stream(state.plan(int(body.get("max_tokens", 16)), k))

        def _stream(self, steps: list) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            made = drafted_total = accepted_total = 0
            total = sum(tokens for _, _, tokens in steps)
            for drafted, accepted, tokens in steps:
                state.count(drafted, accepted)
                drafted_total += drafted
                accepted_total += accepted
                for _ in range(tokens):
                    made += 1
                    if state.mode == "cut" and made > total // 2:
                        self.wfile.flush()
                        self.close_connection = True
                        return  # cut off halfway: no [DONE]
                    if state.mode == "slow" and made == 3:
                        time.sleep(3.0)
                    timings = {"predicted_n": made, "predicted_ms": made * 1.0, "prompt_ms": 1.0}
                    if drafted_total:
                        timings.update(draft_n=drafted_total, draft_n_accepted=accepted_total)
                    finish = "length" if made == total else None
                    self._event({"choices": [{"text": WORDS[made % len(WORDS)], "index": 0, "logprobs": None,
                                              "finish_reason": finish}], "object": "text_completion",
                                 "timings": timings})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, payload: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


class FakeServer:
    def __init__(self, mode: str = "ok", default_k: int = 4):
        self.state = FakeState(mode, default_k)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def expected_text(tokens: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(1, tokens + 1))
