"""The finished stages' metrics of a training run directory, as one JSON object (the GPU training scripts keep
it current while they run, so that a run stopped at its limit still brings them back):

    python scripts/training/stage_metrics.py RUN_DIR OUT.json
"""
import argparse
import json
import sys
from pathlib import Path


def main(run: Path, out: Path) -> None:
    found = {}
    for stage in sorted(run.glob("*")):
        metrics = stage / "metrics.json"
        if metrics.exists() and (stage / "done.json").exists():
            data = json.loads(metrics.read_text())
            data.pop("history", None)
            found[stage.name] = data
    out.write_text(json.dumps(found, indent=1))


def cli(argv: list) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, metavar="RUN_DIR",
                        help="a training run directory (one folder a stage)")
    parser.add_argument("out", type=Path, metavar="OUT.json", help="where the metrics go")
    args = parser.parse_args(argv)
    main(args.run, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
