"""A saved `bench batch --json` report with its roofline fits and predictions made again by this build's
model, from the same measured rows and machine rates (nothing is re-measured); prints its table.

    python scripts/docs/refit_batch.py IN.json OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, metavar="IN.json", help="a saved `bench batch --json` report")
    parser.add_argument("target", type=Path, metavar="OUT.json", help="where the refitted report goes")
    args = parser.parse_args(argv)
    source, target = args.source, args.target
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
