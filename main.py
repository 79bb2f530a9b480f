"""specplay: the desktop playground by default; `python main.py --help` lists the headless commands."""
import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
