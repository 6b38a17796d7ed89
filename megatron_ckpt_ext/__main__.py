"""Command line: ``python -m megatron_ckpt_ext [--version] doctor [--json] [--version]``."""

from __future__ import annotations

import argparse
import sys
import warnings

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    version = f"megatron-ckpt-ext {__version__}"
    parser = argparse.ArgumentParser(prog="python -m megatron_ckpt_ext",
                                     description="megatron-ckpt-ext utilities")
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="show the installed backends and which features they "
                            "offer, ending with a one-line verdict")
    doctor.add_argument("--json", action="store_true", help="print a JSON document for machines")
    doctor.add_argument("--version", action="version", version=version)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from . import doctor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backend import chatter is not the doctor's output
        data = doctor.report()
    print(doctor.to_json(data) if args.json else doctor.format_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
