"""Command line: ``python -m megatron_ckpt_ext [--version] {doctor [--json], verify DIR, shm list|clean}``."""

from __future__ import annotations

import argparse
import sys
import warnings

__all__ = ["main"]


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


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
    verify = sub.add_parser("verify", help="check a checkpoint's files against its integrity "
                            "manifest; exit 1 naming each bad file, 2 when there is nothing to "
                            "check")
    verify.add_argument("dir", help="a checkpoint directory (iter_XXXXXXX), or a save root: "
                        "the checkpoint its tracker names")
    verify.add_argument("--iteration", type=int, default=None,
                        help="with a save root: this iteration instead of the tracker's")
    verify.add_argument("--workers", type=_at_least_one, default=8,
                        help="files checked at once (at least 1)")
    shm = sub.add_parser("shm", help="the sealed memory snapshots and staging segments this node "
                         "holds in /dev/shm: list them, or clean them up")
    shm.add_argument("action", choices=("list", "clean"),
                     help="list: each sealed snapshot (save root, iteration, rank, bytes, age, "
                     "who sealed it, whether a running job maps it) and our other segments; "
                     "clean: remove the snapshots of ended runs and the segments no live "
                     "process maps (a running job's are left to it)")
    shm.add_argument("--dir", default="/dev/shm", help="the shared-memory directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "verify":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's import chatter (pynvml) is not ours to print
            from .verify_cli import run

        return run(args.dir, iteration=args.iteration, workers=args.workers)
    if args.command == "shm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from .shm_cli import run as shm

        return shm(args.action, shm_dir=args.dir)
    from . import doctor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backend import chatter is not the doctor's output
        data = doctor.report()
    print(doctor.to_json(data) if args.json else doctor.format_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
