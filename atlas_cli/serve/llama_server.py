"""`atlas-llama-server`: `atlas serve` behind llama-server's command line.

Tools that launch llama.cpp's `llama-server` themselves (Lemonade's llama.cpp backend, with
`LEMONADE_LLAMACPP_CPU_BIN` and friends) can launch atlas instead. It reads the flags that
matter (-m, --port, --host, -c/--ctx-size, -a/--alias, --api-key), ignores llama.cpp's own
tuning flags (-ngl, --jinja, --keep, --reasoning-format, ...), and, as llama-server does,
answers whatever model name a request carries.
"""

from __future__ import annotations

import argparse
import sys

from atlas_cli.errors import AtlasError


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="atlas-llama-server", allow_abbrev=False)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-a", "--alias")
    p.add_argument("--api-key")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    from atlas_cli.serve.server import serve

    args, ignored = parse(sys.argv[1:] if argv is None else argv)
    if ignored:
        print(f"atlas-llama-server: ignoring {' '.join(ignored)}", file=sys.stderr)
    try:
        serve(
            args.model,
            host=args.host,
            port=args.port,
            served_model_name=args.alias,
            api_key=args.api_key,
            ctx_size=args.ctx_size or None,  # llama-server's 0 means the model's own
            accept_any_model=True,
        )
    except AtlasError as exc:
        print(f"atlas: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
