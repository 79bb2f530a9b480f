"""engine.kernels.cuda_calls: the round loop's raw CUDA calls do what torch's do (copies, events, graph
launches), and
a generation gives the same events with them as with torch's."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
pytest.importorskip("cupy")

from tiny_models import make_tiny_llama  # noqa: E402

from engine.bench.timing import RoundClock  # noqa: E402
from engine.config import GenerationConfig  # noqa: E402
from engine.core.decoder import SpeculativeDecoder  # noqa: E402
from engine.kernels import cuda_calls  # noqa: E402
from engine.kernels.cuda_calls import StreamCalls  # noqa: E402
from engine.models.loading import load_pair  # noqa: E402
from engine.models.runner import graph_capture, warm_up_stream  # noqa: E402


@pytest.fixture
def calls():
    stream = torch.cuda.current_stream()
    made = StreamCalls(stream)
    assert made.raw, "CuPy is importable, so the calls must be the raw ones"
    return made


def test_copy_to_host_is_the_device_tensor(calls):
    for dtype in (torch.float32, torch.long):
        device = (torch.arange(300, device="cuda") * 7 - 5).to(dtype)
        host = torch.empty(300, dtype=dtype, pin_memory=True)
        calls.copy_to_host(host, device)
        calls.event().synchronize()
        assert torch.equal(host, device.cpu())


def test_events_time_the_queued_work_and_come_back_in_turn(calls):
    x = torch.randn(2048, 2048, device="cuda")
    start = calls.event()
    for _ in range(20):
        x = x @ x / 2048 ** 0.5
    end = calls.event()
    end.synchronize()
    assert end.elapsed_time(start) < 0.0 < start.elapsed_time(end)
    fresh = StreamCalls(torch.cuda.current_stream())
    handles = [fresh.event().handle for _ in range(StreamCalls.EVENTS + 2)]
    # EVENTS events made at most, then handed out again in the order they were made
    assert len(set(handles)) == StreamCalls.EVENTS
    assert handles[StreamCalls.EVENTS:] == handles[:2]


def test_raw_launch_runs_the_captured_work(calls):
    x = torch.zeros(64, device="cuda")
    with warm_up_stream(x.device):
        x.add_(1)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, None, x.device):  # the product's guards (no cyclic collection inside)
        x.mul_(2).add_(1)
    x.zero_()
    for _ in range(3):
        calls.launch(graph)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 15.0))  # 0 -> 1 -> 3 -> 7 -> 15


def test_round_clock_marks_with_the_given_event(calls):
    clock = RoundClock(torch.device("cuda"), calls)
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(10):
        x = x @ x / 32.0
    copied = calls.event()
    clock.mark(copied)
    copied.synchronize()
    assert clock.marks[-1] is copied
    gpu_ms, rest = clock.phases_ms()
    assert gpu_ms > 0.0 and rest >= 0.0


@pytest.mark.parametrize("method", ["none", "ngram", "medusa", "eagle", "eagle:8", "draft"])
def test_generation_is_the_same_with_torch_calls(tmp_path, monkeypatch, method):
    """bf16 on the decode kernels, replayed rounds: the raw calls change the host's calls only."""
    from test_tree_methods import add_random_eagle_head, add_random_medusa_heads

    target = make_tiny_llama(tmp_path / "target", vocab=96, hidden=64, layers=2, seed=0, std=0.15)
    add_random_medusa_heads(target, 64)
    add_random_eagle_head(target, 64)
    draft = make_tiny_llama(tmp_path / "draft", vocab=96, hidden=64, layers=1, seed=1, std=0.15)
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cuda", dtype=torch.bfloat16))
    config = GenerationConfig(k=4, max_new_tokens=40, stop_at_eos=False).with_spec(method)

    runtime = cuda_calls._runtime

    def events(raw: bool):  # without the runtime's bindings, StreamCalls makes torch's calls (no CuPy)
        monkeypatch.setattr(cuda_calls, "_runtime", runtime if raw else lambda: None)
        decoder._calls = None
        return [(e.emitted_ids, e.accepted_count, [t.token_id for t in e.drafted])
                for e in decoder.generate("the cat sat on the mat. the cat", config)]

    assert events(True) == events(False) == events(True)
