"""The real llama-server (built by scripts/peers/build_llama_server.sh into a cache outside the repo) as a
test peer: found, started on a free loopback port serving the shipped pair as f32 GGUF, and stopped."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "peers" / "build_llama_server.sh"
START_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True,
                         check=True)
    return Path(out.stdout.strip())


def peer_files() -> dict:
    """{server, target, draft}: the built peer's paths (they may not exist)."""
    cache = cache_dir()
    return {"server": cache / "bin" / "llama-server", "target": cache / "gguf" / "target-f32.gguf",
            "draft": cache / "gguf" / "draft-f32.gguf"}


def missing() -> list:
    return [str(path) for path in peer_files().values() if not path.exists()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(k: int = 4, parallel: int = 4, threads: int = 2, log=None):
    """`llama-server -m target.gguf [-md draft.gguf --spec-type draft-simple --spec-draft-n-max K] --metrics`
    on 127.0.0.1:<free port> (k = 0: plain, no draft model); yields its URL. This llama.cpp takes K and the
    method at its start only (its per-request speculative fields are compiled out)."""
    files, port = peer_files(), free_port()
    command = [str(files["server"]), "-m", str(files["target"]), "--host", "127.0.0.1", "--port", str(port),
               "--metrics", "-np", str(parallel), "-c", str(1024 * parallel), "-t", str(threads),
               "--no-webui", "--no-warmup"]
    if k:
        command += ["-md", str(files["draft"]), "-td", str(threads), "--spec-type", "draft-simple",
                    "--spec-draft-n-max", str(k)]
    process = subprocess.Popen(command, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {process.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if json.loads(reply.read()).get("status") == "ok":
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"llama-server did not become healthy within {START_TIMEOUT_S:.0f} s")
