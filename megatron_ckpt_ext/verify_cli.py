"""``python -m megatron_ckpt_ext verify DIR``: check a checkpoint against its manifest, in
parallel, with progress on stderr; exit 0 when every file matches, 1 naming each bad file, 2 when
there is nothing to check (no checkpoint, or a stock checkpoint without a manifest); a checkpoint
the plugin wrote whose manifest is missing is bad (1)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .manifest import MANIFEST, unlisted, verify_files
from .load.verify import check_manifest
from .save.layout import METADATA, checkpoint_name, parse_iteration, read_tracker

__all__ = ["run"]

# what to do about a manifest that cannot be trusted, by ManifestCheck.kind
_FIXES = {
    "damaged": "the manifest is damaged: nothing in the checkpoint can be trusted to match it",
    "missing": f"restore {MANIFEST} from a copy of this checkpoint; without it nothing here can "
               "be verified",
}


def run(folder: str, *, iteration: int | None = None, workers: int = 8) -> int:
    path = _checkpoint(Path(folder), iteration)
    if path is None:
        return 2
    check = check_manifest(path)
    if check.kind:
        why = _unnamed(check.why)  # the line names the file already
        print(f"BAD {path / MANIFEST}: {why}")
        if check.kind in _FIXES:
            print(f"{path}: {_FIXES[check.kind]}", file=sys.stderr)
        return 1
    manifest = check.manifest
    if manifest is None:
        print(f"{path}: no {MANIFEST} (saved by stock Megatron or an older plugin): nothing to "
              "verify", file=sys.stderr)
        return 2
    total = sum(f["bytes"] for f in manifest["files"].values())
    print(f"verifying {path}: {len(manifest['files'])} files, {total / 1e9:.2f} GB, "
          f"{workers} at a time", file=sys.stderr)
    t0 = time.perf_counter()
    problems = unlisted(path, manifest) + verify_files(
        path, manifest, workers=workers, progress_every_s=1.0,
        log=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - t0
    for name in manifest.get("unverified", []):
        print(f"{path / name}: not covered by the manifest (no checksum was recorded)",
              file=sys.stderr)
    if problems:
        for p in problems:
            print(f"BAD {path / p.file}: {p.why}")
        listed = [p for p in problems if p.file in manifest["files"]]
        stray = len(problems) - len(listed)
        print(f"{path}: " + "; ".join(
            part for part in (
                f"{len(listed)} of the {len(manifest['files'])} files it lists do not match"
                if listed else "",
                f"{stray} file(s) it does not list" if stray else "") if part)
            + f" (checked in {seconds:.1f} s)", file=sys.stderr)
        return 1
    uncovered = manifest.get("unverified", [])
    print(f"OK {path}: {len(manifest['files'])} files, {total / 1e9:.2f} GB match their CRC-32 "
          f"({seconds:.1f} s, {total / max(seconds, 1e-9) / 1e9:.2f} GB/s)"
          + (f"; {len(uncovered)} file(s) not covered (no checksum recorded)" if uncovered
             else ""))
    return 0


def _unnamed(why: str) -> str:
    for prefix in (f"{MANIFEST}: ", f"{MANIFEST} "):
        why = why.removeprefix(prefix)
    return why


def _checkpoint(folder: Path, iteration: int | None) -> Path | None:
    if not folder.is_dir():
        print(f"{folder}: no such directory", file=sys.stderr)
        return None
    if (folder / MANIFEST).exists() or (folder / METADATA).exists():
        named = parse_iteration(folder.name)
        if iteration is not None and iteration != named:
            print(f"{folder} is a checkpoint directory{f' (iteration {named})' if named else ''}"
                  f": --iteration {iteration} applies to a save root. Pass the save root "
                  f"({folder.parent}) with --iteration {iteration}, or drop --iteration.",
                  file=sys.stderr)
            return None
        return folder
    try:
        iteration = iteration if iteration is not None else read_tracker(folder)
    except ValueError as e:
        print(e, file=sys.stderr)
        return None
    if iteration is None:
        print(f"{folder}: not a checkpoint directory and no tracker names one", file=sys.stderr)
        return None
    path = checkpoint_name(folder, iteration)
    if not path.is_dir():
        print(f"{path}: no such checkpoint", file=sys.stderr)
        return None
    return path
