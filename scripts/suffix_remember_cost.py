"""What a model load adds on the window's thread for a kept session: suffix decoding's memory indexing the
History's suffix generations (SuffixMemory.remember), here 100 generations of 260 random tokens, three times.

    python scripts/suffix_remember_cost.py
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from engine.drafters.suffix import SuffixMemory

    rng = random.Random(0)
    documents = [[rng.randrange(8192) for _ in range(260)] for _ in range(100)]
    for _ in range(3):
        memory = SuffixMemory()
        start = time.perf_counter()
        memory.remember(documents)
        print(f"{(time.perf_counter() - start) * 1000:.1f} ms for {len(documents)} generations, "
              f"{sum(map(len, documents))} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
