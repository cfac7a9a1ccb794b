"""The `jhybrid` console script."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jhybrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "version":
        import jhybrid

        print(jhybrid.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
