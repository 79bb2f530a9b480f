"""The finished stages' metrics of a training run directory, as one JSON object (the GPU training scripts keep
it current while they run, so that a run stopped at its limit still brings them back):

    python scripts/stage_metrics.py RUN_DIR OUT.json
"""
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


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
