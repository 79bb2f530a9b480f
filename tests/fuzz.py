"""How many random cases the GPU kernel fuzz tests run: `pytest --fuzz-cases N` (tests/conftest.py sets it
before the test modules are collected), else each module's own default."""
from typing import Optional

override: Optional[int] = None


def cases(default: int) -> int:
    return default if override is None else override
