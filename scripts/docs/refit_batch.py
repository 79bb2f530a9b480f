"""A saved `bench batch --json` report with its roofline fits and predictions made again by this build's
model, from the same measured rows and machine rates (nothing is re-measured); prints its table.

    python scripts/docs/refit_batch.py IN.json OUT.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plot_batch import in_and_out  # this folder: the command line of both report tools

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list) -> int:
    source, target = in_and_out(argv, __doc__, ("IN.json", "a saved `bench batch --json` report"),
                                ("OUT.json", "where the refitted report goes"))
    from engine.bench.batch import format_json, refit_report

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
