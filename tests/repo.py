"""The repository root, for tests that start the package in a subprocess or read files beside it
(one place, so a test file's depth under tests/ does not matter)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
