"""The argument parser every `kareus` command uses: a usage error is one line and exit status 2."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line ("PROG: error: MESSAGE"), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse declares NoReturn
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)
