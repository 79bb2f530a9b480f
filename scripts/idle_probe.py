"""Plain rounds of the shipped pair right after what calibration does before them (the block-by-block
verification curve, a draft run, an idle pause, a whole calibration), twice over:

    python scripts/idle_probe.py cuda

Each line: mean and median ms a round (rounds 1.. of two 24-token generations after a 4-token warm-up), the
mean phases (draft, verify, overhead) and the first rounds."""

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import GenerationConfig  # noqa: E402
from engine.costmodel import VERIFY_SIZES  # noqa: E402
from engine.decoder import SpeculativeDecoder  # noqa: E402
from engine.models import load_pair  # noqa: E402

PROMPT = "def merge(a, b):\n    "  # calibration's prompt


def time_plain(decoder, k: int, label: str, tokens: int = 24) -> None:
    config = GenerationConfig(method="none", k=k, max_new_tokens=tokens, stop_at_eos=False)
    list(decoder.generate(PROMPT, replace(config, max_new_tokens=4)))
    rounds = [e for _ in range(2) for e in decoder.generate(PROMPT, config) if e.round > 0]
    times = [e.draft_ms + e.verify_ms + e.overhead_ms for e in rounds]
    phases = [round(statistics.fmean(getattr(e, p) for e in rounds), 3)
              for p in ("draft_ms", "verify_ms", "overhead_ms")]
    first = [round(t, 2) for t in times[:5]]
    print(f"{label:40s} k={k} n={tokens}: mean {statistics.fmean(times):.3f} median "
          f"{statistics.median(times):.3f} phases {phases} first {first}", flush=True)


def main() -> int:
    decoder = SpeculativeDecoder(load_pair(None, None, device=sys.argv[1] if len(sys.argv) > 1 else "cuda"))
    decoder.warm_up()

    def curve():
        decoder.verify_curve(PROMPT, VERIFY_SIZES, 2, 30)

    for _ in range(2):
        time_plain(decoder, 8, "plain first")
        time_plain(decoder, 1, "plain first k=1")
        curve()
        time_plain(decoder, 8, "after verify_curve")
        curve()
        time_plain(decoder, 1, "after verify_curve k=1")
        curve()
        time_plain(decoder, 8, "after verify_curve again")
        list(decoder.generate(PROMPT, GenerationConfig(method="draft", k=4, max_new_tokens=64)))
        time_plain(decoder, 8, "after a draft run")
        time.sleep(0.5)
        time_plain(decoder, 8, "after 0.5 s idle")
        decoder.calibrate(8)
        time_plain(decoder, 8, "after calibrate(8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
