"""torch's CPU thread count: chosen for the model and the machine, --threads and OMP_NUM_THREADS win."""
from __future__ import annotations

import pytest
import torch

from engine.core import threads
from engine.errors import SpecplayError

BIG = 10 * threads.SMALL_MODEL_PARAMS


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tiny_models import make_tiny_pair

    target, draft = make_tiny_pair(tmp_path_factory.mktemp("threads"))
    return str(target), str(draft)


@pytest.mark.parametrize("params, requested, env, cores, expected", [
    (1000, None, {}, 8, 1),  # a small model: one thread
    (BIG, None, {}, 8, 7),  # a large one: physical cores less one
    (BIG, None, {}, 2, 1),
    (BIG, None, {}, 1, 1),
    (BIG, None, {"OMP_NUM_THREADS": "3"}, 8, 3),  # the environment is respected
    (1000, None, {"OMP_NUM_THREADS": "4,2"}, 8, 4),  # OpenMP's nested form
    (1000, None, {"MKL_NUM_THREADS": "2"}, 8, 2),
    (BIG, None, {"OMP_NUM_THREADS": "lots"}, 8, 7),  # a value that is no count is ignored
    (BIG, None, {"OMP_NUM_THREADS": "0"}, 8, 7),
    (1000, 6, {"OMP_NUM_THREADS": "3"}, 8, 6),  # --threads wins
])
def test_choose_threads(params, requested, env, cores, expected):
    assert threads.choose_threads(params, requested, environ=env, cores=cores) == expected


@pytest.mark.parametrize("bad", [0, -1, threads.MAX_THREADS + 1, 2.5, True, "4"])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(SpecplayError, match="--threads"):
        threads.check_threads(bad)


def test_physical_cores_are_at_most_the_usable_cpus():
    assert 1 <= threads.physical_cores() <= threads.usable_cpus()


def test_count_weights_counts_the_model_not_its_cache(pair):
    from tiny_models import load_hf_reference

    from engine.models.loading import load_pair

    loaded = load_pair(pair[0], pair[1], device="cpu")
    expected = sum(p.numel() for p in load_hf_reference(pair[0]).parameters())
    counted = threads.count_weights(loaded.target)
    assert expected <= counted <= expected + 1024  # + rotary frequencies
    assert threads.count_weights(loaded.target, loaded.draft) > counted
    assert threads.count_weights(None) == 0


def run_tiny(pair, capsys, *extra):
    from engine.cli.main import main

    code = main(["run", "--prompt", "hello", "--target", pair[0], "--draft", pair[1], "--max-new-tokens", "2",
                 *extra])
    assert code == 0, capsys.readouterr().err


def test_a_run_applies_threads(pair, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    run_tiny(pair, capsys)
    assert torch.get_num_threads() == 1  # a tiny model decodes on one thread
    run_tiny(pair, capsys, "--threads", "2")
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    run_tiny(pair, capsys)
    assert torch.get_num_threads() == 3


def test_the_gui_loader_applies_threads(pair, monkeypatch):
    from app import backend

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(backend, "THREADS", 2)
    backend.load_decoder(pair[0], pair[1], "cpu")
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(backend, "THREADS", None)
    backend.load_decoder(pair[0], pair[1], "cpu")
    assert torch.get_num_threads() == 1


def test_main_py_gui_passes_threads_to_the_loader(monkeypatch):
    import importlib.util
    from pathlib import Path

    import app.main_window
    from app import backend

    spec = importlib.util.spec_from_file_location("specplay_main", Path(__file__).parents[1] / "main.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    monkeypatch.setattr(app.main_window, "run_gui", lambda **kw: 0)
    monkeypatch.setattr(backend, "THREADS", None)
    assert entry.main(["gui", "--threads", "3"]) == 0
    assert backend.THREADS == 3
