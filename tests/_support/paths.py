"""Where things are, for tests at any depth under tests/."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SRC = str(ROOT / "src")
FIXTURES = TESTS / "fixtures"
HF_FIXTURES = FIXTURES / "hf"
EXAMPLES = ROOT / "examples"
SUPPORT = TESTS / "_support"
