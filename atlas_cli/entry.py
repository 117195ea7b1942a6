"""The `atlas` console script, kept light: a Tab is answered from the cached command table when
it can be (atlas_cli/completion_cache.py), and everything else runs the CLI (atlas_cli/cli.py).
A shell runs this on every Tab, so nothing here imports Typer until it must."""

from __future__ import annotations

import os
import sys

from atlas_cli.completion import COMPLETE_VAR


def main() -> None:
    instruction = os.environ.get(COMPLETE_VAR)
    if instruction:
        from atlas_cli.completion_cache import complete_from_cache

        done = complete_from_cache(instruction)
        if done is not None:
            output, status = done
            sys.stdout.write(output)
            sys.stdout.flush()
            raise SystemExit(status)
    from atlas_cli.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
