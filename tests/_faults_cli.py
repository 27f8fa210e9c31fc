"""Fault rows: command-line arguments refused before anything runs."""
from _fault import Fault

ROWS = [
    Fault("cli-unknown-command", ["nosuchcommand"], rc=2, words=("invalid choice",)),
]
