"""scripts/peers/build_llama_server.sh: its help, its refusal of unknown arguments and its cache outside the
repo (the build itself runs in .ci/run and is used by tests/test_server_llamacpp.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "peers" / "build_llama_server.sh"


def run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=env)


def test_help():
    result = run("--help")
    assert result.returncode == 0
    assert "llama-server" in result.stdout and "convert_hf_to_gguf" in result.stdout


def test_unknown_argument_is_refused():
    result = run("--bogus")
    assert result.returncode == 2 and "unknown argument" in result.stderr


def test_cache_is_outside_the_repo_and_versioned(tmp_path):
    version = (REPO / "scripts" / "peers" / "llama_cpp_version").read_text().strip()
    result = run("--print-dir", env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    path = Path(result.stdout.strip())
    assert result.returncode == 0 and path == tmp_path / ".cache" / "specplay" / "llama.cpp" / version
    assert REPO not in path.parents


def test_a_missing_python_fails_loudly(tmp_path):
    result = run(env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHON": str(tmp_path / "none")})
    assert result.returncode == 1 and "FAILED" in result.stderr
