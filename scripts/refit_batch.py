"""A saved `bench batch --json` report with its roofline fits and predictions made again by this build's
model, from the same measured rows and machine rates (nothing is re-measured); prints its table.

    python scripts/refit_batch.py IN.json OUT.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list) -> int:
    from engine.batch_bench import format_json, refit_report

    if len(argv) != 2:
        print("usage: python scripts/refit_batch.py IN.json OUT.json", file=sys.stderr)
        return 2
    source, target = (Path(a) for a in argv)
    try:
        saved = json.loads(source.read_text(encoding="utf-8"))
        refitted = refit_report(saved)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot refit {source}: {exc}", file=sys.stderr)
        return 2
    target.write_text(json.dumps(refitted, indent=1) + "\n", encoding="utf-8")
    print(format_json(refitted))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
