"""Where things are, for tests at any depth under ``tests/``: the tests directory and the repository root."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
