"""The integrity manifest: writers checksum what they write, the commit folds it into
mcx_manifest.json, ``verify`` and ``load`` refuse flipped bits. Real saves need a process group:
a one-rank gloo group in this process, and two spawned ranks for the split verification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, manifest
from megatron_ckpt_ext.__main__ import main
from megatron_ckpt_ext.errors import CheckpointIntegrityError
from megatron_ckpt_ext.load.report import LOAD_PHASES
from tests._support.dist import run_ranks, sharded

from . import _integrity_workers as iw

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


MODES = {
    "sync": {},
    "async-persistent-cpu-shm": {"async_save": True, "use_persistent_ckpt_worker": True,
                                 "async_ckpt_use_cpu_shm": True,
                                 "ckpt_assume_constant_structure": True},
    "async-temporal": {"async_save": True},
}


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step, "b": torch.full((64,), float(step))}


def _save(root: Path, steps, **options) -> None:
    with Checkpointer(CkptOptions(**options)) as ck:
        for step in steps:
            ck.save(sharded(0, 1, _state(step)), root, iteration=step)
            ck.maybe_finalize(blocking=True)


def _load(root: Path, iteration=None, **options) -> dict:
    like = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with Checkpointer(CkptOptions(**options)) as ck:
        return ck.load(sharded(0, 1, like), root, iteration=iteration)


def _data_file(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"))


def _flip_bit(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_writer_checksums_each_data_file_as_it_writes(tmp_path, monkeypatch, mode):
    """The data files' CRC-32 comes from the writer (the commit sums no file here: its size limit
    is 0), equals the file's, and the manifest is committed inside the checkpoint."""
    monkeypatch.setattr(manifest, "_SMALL", 0)
    _save(tmp_path, [1], **MODES[mode])
    found = json.loads((tmp_path / "iter_0000001" / manifest.MANIFEST).read_text())
    data = _data_file(tmp_path / "iter_0000001")
    assert found["files"][data.name] == {"bytes": data.stat().st_size,
                                         "crc32": manifest.file_crc32(data)}
    assert not (tmp_path / "iter_0000001" / manifest.SUMS_DIR).exists()
    assert found["iteration"] == 1 and found["algorithm"] == "crc32"


def test_without_writer_checksums_large_files_are_listed_unverified(tmp_path, monkeypatch,
                                                                     caplog, capsys):
    """A file without a checksum is never passed off as checked: the load reports
    ``verified: False`` with one warning naming it, and ``verify`` says it is not covered."""
    from megatron_ckpt_ext import verify_cli

    monkeypatch.setattr(manifest, "_SMALL", 0)
    monkeypatch.setenv("MCX_WRITE_CHECKSUMS", "0")
    _save(tmp_path, [1])
    found = json.loads((tmp_path / "iter_0000001" / manifest.MANIFEST).read_text())
    data = _data_file(tmp_path / "iter_0000001").name
    assert data in found["unverified"]
    with Checkpointer(CkptOptions()) as ck:
        ck.load(sharded(0, 1, {k: torch.zeros_like(v) for k, v in _state(0).items()}), tmp_path)
        assert ck.load_reports[-1]["verified"] is False
    warning = [r.message for r in caplog.records if "have no checksum" in r.message]
    assert len(warning) == 1 and data in warning[0], caplog.text
    assert verify_cli.run(str(tmp_path / "iter_0000001")) == 0
    assert f"{len(found['unverified'])} file(s) not covered" in capsys.readouterr().out


def test_verify_command_names_each_bad_file(tmp_path, capsys):
    _save(tmp_path, [1, 2])
    assert main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {tmp_path / 'iter_0000002'}")
    bad = _data_file(tmp_path / "iter_0000002")
    _flip_bit(bad)
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {bad}: CRC-32" in out
    assert main(["verify", str(tmp_path), "--iteration", "1"]) == 0
    (tmp_path / "iter_0000001" / manifest.MANIFEST).unlink()
    assert main(["verify", str(tmp_path / "iter_0000001")]) == 1  # ours, its manifest deleted
    (tmp_path / "iter_0000001" / manifest.MARKER).unlink()
    assert main(["verify", str(tmp_path / "iter_0000001")]) == 2  # stock: nothing to check
    assert main(["verify", str(tmp_path / "nothing")]) == 2


def test_load_refuses_flipped_bits_naming_file_and_iteration(tmp_path):
    _save(tmp_path, [1, 2])
    assert torch.equal(_load(tmp_path)["w"], _state(2)["w"])
    bad = _data_file(tmp_path / "iter_0000002")
    payload = _state(2)["w"].numpy().tobytes()[:256]  # inside w's bytes: a silent wrong value
    _flip_bit(bad, offset=bad.read_bytes().index(payload) + 130)
    with pytest.raises(CheckpointIntegrityError) as e:
        _load(tmp_path)
    assert "iteration 2" in str(e.value) and bad.name in str(e.value)
    assert "--ckpt-load-fallback" in str(e.value)
    loaded = _load(tmp_path, ckpt_verify_load=False)  # what stock megatron-core would load
    assert not torch.equal(loaded["w"], _state(2)["w"])


def test_fallback_loads_the_newest_older_checkpoint_that_verifies(tmp_path, caplog):
    _save(tmp_path, [1, 2, 3])
    _flip_bit(_data_file(tmp_path / "iter_0000003"))
    _flip_bit(_data_file(tmp_path / "iter_0000002"), offset=-3000)
    with caplog.at_level("WARNING"):
        got = _load(tmp_path, ckpt_load_fallback=True)
    assert torch.equal(got["w"], _state(1)["w"])
    assert any("loading iteration 1 instead" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointIntegrityError):  # an explicit iteration never falls back
        _load(tmp_path, iteration=3, ckpt_load_fallback=True)


def test_a_file_added_after_the_commit_is_refused(tmp_path, capsys):
    """A file megatron-core would read but the manifest does not list (a stray common.pt: on
    megatron-core 0.19, whose common state lives in the .distcp files, it would be loaded) makes
    ``verify`` exit 1 and the load refuse, naming it."""
    from megatron_ckpt_ext import verify_cli

    _save(tmp_path, [1])
    checkpoint = tmp_path / "iter_0000001"
    listed = json.loads((checkpoint / manifest.MANIFEST).read_text())["files"]
    stray = next(n for n in ("common.pt", "__9_0.distcp") if n not in listed)
    (checkpoint / stray).write_bytes(b"added later")
    assert verify_cli.run(str(checkpoint)) == 1
    out, err = capsys.readouterr()
    assert f"BAD {checkpoint / stray}: not in the manifest" in out
    assert "1 file(s) it does not list" in err and "do not match" not in err, err
    with pytest.raises(CheckpointIntegrityError, match=f"{stray}: not in the manifest"):
        _load(tmp_path)
    (checkpoint / "notes.txt").write_text("a user's note is not a checkpoint file")
    (checkpoint / stray).unlink()
    assert verify_cli.run(str(checkpoint)) == 0
    _load(tmp_path)


def test_a_truncated_file_is_named_and_a_stock_checkpoint_loads(tmp_path):
    _save(tmp_path, [1])
    path = tmp_path / "iter_0000001"
    data = _data_file(path)
    raw = data.read_bytes()
    data.write_bytes(raw[:-10])
    with pytest.raises(CheckpointIntegrityError, match="bytes, the manifest says"):
        _load(tmp_path)
    data.write_bytes(raw)
    (path / manifest.MANIFEST).unlink()  # as stock megatron-core writes it: no manifest
    (path / manifest.MARKER).unlink()  # and no mark of ours
    with Checkpointer(CkptOptions()) as ck:
        like = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        assert torch.equal(ck.load(sharded(0, 1, like), tmp_path)["w"], _state(1)["w"])
        assert ck.load_reports[-1]["verified"] is False
        assert set(ck.load_reports[-1]["phases"]) == set(LOAD_PHASES)


def test_two_ranks_split_the_verification_and_both_name_the_bad_file(tmp_path):
    """Each rank checks half of the files; a flipped bit in a file only rank 1 checks still
    fails the load on both ranks, naming the file."""
    run_ranks(iw.save_two_ranks, world_size=2, timeout=120, args=(str(tmp_path),))
    names = sorted(json.loads((tmp_path / "iter_0000001" / manifest.MANIFEST).read_text())["files"])
    bad = tmp_path / "iter_0000001" / names[1]  # rank 1's share: names[1::2]
    _flip_bit(bad, offset=-1)
    run_ranks(iw.load_fails_naming, world_size=2, timeout=120, args=(str(tmp_path), bad.name))


def test_no_rank_reads_again_a_file_another_ranks_load_summed(tmp_path):
    """At 3 ranks, a rank's share of the check (every 3rd of 7 files) holds another rank's data
    file, which that rank's reads summed as they passed: the check leaves it out (one all-gather
    of what each rank summed), so no data file is read twice, and the load still verifies."""
    run_ranks(iw.save_two_ranks, world_size=3, timeout=120, args=(str(tmp_path),))
    run_ranks(iw.load_reads_no_summed_file_twice, world_size=3, timeout=120,
              args=(str(tmp_path),))


# -- parallel reads (--ckpt-load-threads) ----------------------------------------------------------
def test_parallel_reads_load_bit_exact_and_reshard(tmp_path):
    """The items are read by the parallel reader (its class is built and used), the values are
    bit-exact, and a load of half of a saved tensor (narrowed items) reads the right half."""
    from megatron_ckpt_ext.backend import load_reader

    big = {f"t{i}": torch.randn(3000 + 2 * i) for i in range(12)}
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, big), tmp_path, iteration=1)
    load_reader._CLASSES.clear()
    like = {k: torch.zeros_like(v) for k, v in big.items()}
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        got = ck.load(sharded(0, 1, like), tmp_path)
    assert load_reader._CLASSES, "the parallel reader was not used"
    assert (ck.load_reports[-1]["direct_items"], ck.load_reports[-1]["stock_items"]) == (12, 0)
    assert all(torch.equal(got[k], v) for k, v in big.items())
    torch.save(big, tmp_path / "expected.pt")  # two ranks each load half (a new layout)
    run_ranks(iw.load_halves, world_size=2, timeout=120, args=(str(tmp_path),))
    load_reader._CLASSES.clear()
    with Checkpointer(CkptOptions(ckpt_load_threads=1)) as ck:  # megatron-core's own loop
        got = ck.load(sharded(0, 1, {k: torch.zeros_like(v) for k, v in big.items()}), tmp_path)
    assert not load_reader._CLASSES and all(torch.equal(got[k], v) for k, v in big.items())


def test_a_resume_allocates_the_staging_buffers_for_the_first_save(tmp_path):
    """With cpu-shm staging, load() leaves the staging segments of the loaded structure
    allocated (in the background), before any save; without a load nothing is allocated."""
    import glob
    import uuid

    _save(tmp_path, [1])
    options = CkptOptions(**MODES["async-persistent-cpu-shm"])
    job = f"resume{uuid.uuid4().hex[:8]}"
    with Checkpointer(options, job_id=job) as ck:
        assert not glob.glob(f"/dev/shm/mcx_{job}_*")
        like = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        ck.load(sharded(0, 1, like), tmp_path)
        assert ck.wait_prepared(30)
        assert len(glob.glob(f"/dev/shm/mcx_{job}_*")) >= len(like)
    assert not glob.glob(f"/dev/shm/mcx_{job}_*")  # close() frees them


def test_items_the_direct_reader_refuses_load_the_stock_way_and_say_why(tmp_path, monkeypatch,
                                                                        caplog):
    from megatron_ckpt_ext.backend import direct_read

    state = {f"t{i}": torch.randn(500 + i) for i in range(4)}
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    monkeypatch.setattr(direct_read, "item_layout", lambda *a: (None, "a reason to refuse"))
    caplog.set_level("INFO", logger="megatron_ckpt_ext")
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        got = ck.load(sharded(0, 1, {k: torch.zeros_like(v) for k, v in state.items()}),
                      tmp_path)
        report = ck.load_reports[-1]
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert (report["direct_items"], report["stock_items"]) == (0, 4)
    assert "4 of 4 checkpoint items were read the stock way" in caplog.text
    assert "a reason to refuse" in caplog.text


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_load_sums_the_files_it_reads_whole_and_reads_none_twice(tmp_path, monkeypatch,
                                                                     mode):
    """Verification without a second read: the files the load reads every byte of (here every
    data file) are summed by the reading threads as the bytes pass, and only the rest (the
    metadata files) is read again by the check; a flipped bit in a tensor is still refused,
    naming the file."""
    from megatron_ckpt_ext.load import verify

    _save(tmp_path, [1], **MODES[mode])
    checked = []
    real = verify.verify_files
    monkeypatch.setattr(verify, "verify_files",
                        lambda path, m, names, **kw: (checked.extend(names),
                                                      real(path, m, names, **kw))[1])
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        got = ck.load(sharded(0, 1, {k: torch.zeros_like(v) for k, v in _state(0).items()}),
                      tmp_path)
        assert ck.load_reports[-1]["verified"] is True
    assert torch.equal(got["w"], _state(1)["w"])
    data = sorted(p.name for p in (tmp_path / "iter_0000001").glob("*.distcp"))
    assert data and not set(data) & set(checked), checked
    assert {".metadata", "metadata.json"} <= set(checked), checked
    bad = tmp_path / "iter_0000001" / data[0]
    _flip_bit(bad, offset=bad.stat().st_size // 2)
    with pytest.raises(CheckpointIntegrityError, match=f"{bad.name}: CRC-32"):
        _load(tmp_path, ckpt_load_threads=4)


def test_a_refusal_names_the_bad_files_of_both_checks(tmp_path):
    """One bad file the load's reads sum (the data) and one the check beside it reads
    (metadata.json, a trailing space megatron-core still parses): the refusal names both."""
    _save(tmp_path, [1])
    checkpoint = tmp_path / "iter_0000001"
    data = _data_file(checkpoint)
    _flip_bit(data, offset=data.stat().st_size // 2)
    with open(checkpoint / "metadata.json", "a") as fh:
        fh.write(" ")
    with pytest.raises(CheckpointIntegrityError) as raised:
        _load(tmp_path, ckpt_load_threads=4)
    assert f"{data.name}: CRC-32" in str(raised.value), raised.value
    assert "metadata.json: " in str(raised.value), raised.value


def test_a_file_read_in_part_is_summed_with_its_small_gaps_or_else_checked_whole(tmp_path,
                                                                                  monkeypatch):
    """Items a load does not ask for leave gaps in what it reads (megatron-core 0.19 loads the
    common state item of each .distcp file apart): up to 1 MiB of gaps per file are read and
    summed with the rest, so the file is still not read twice; a larger gap sends the file to
    the check beside the load."""
    from megatron_ckpt_ext.load import verify

    state = {"w": torch.randn(4096), "b": torch.randn(64), "small": torch.randn(100),
             "big": torch.randn(300_000)}  # 1.2 MB: over the gap limit
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    checked = []
    real = verify.verify_files
    monkeypatch.setattr(verify, "verify_files",
                        lambda path, m, names, **kw: (checked.extend(names),
                                                      real(path, m, names, **kw))[1])
    data = next((tmp_path / "iter_0000001").glob("*.distcp")).name
    for keys, summed in ((("w", "b", "big"), True), (("w", "b", "small"), False)):
        checked.clear()
        like = {k: torch.zeros_like(state[k]) for k in keys}
        with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
            got = ck.load(sharded(0, 1, like), tmp_path)
            assert ck.load_reports[-1]["verified"] is True
        assert all(torch.equal(got[k], state[k]) for k in keys)
        assert (data not in checked) is summed, (keys, checked)


def test_a_reader_the_direct_path_does_not_take_lets_the_check_start_at_once(tmp_path,
                                                                              monkeypatch):
    """The check beside the load waits to hear which files the reads will sum; a reader the
    parallel path does not take says 'none' when it is built (the check then reads every file
    beside the load, not after it), and the load still verifies."""
    from megatron_ckpt_ext.backend import load_reader
    from megatron_ckpt_ext.load import verify

    _save(tmp_path, [1])
    told = []
    real = verify.Pending.skip
    monkeypatch.setattr(verify.Pending, "skip", lambda self, names: (told.append(set(names)),
                                                                    real(self, names))[1])
    monkeypatch.setattr(load_reader, "_NEEDED", ("an_attribute_no_reader_has",))
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        got = ck.load(sharded(0, 1, {k: torch.zeros_like(v) for k, v in _state(0).items()}),
                      tmp_path)
        assert ck.load_reports[-1]["verified"] is True
    assert torch.equal(got["w"], _state(1)["w"]) and told == [set()], told


def test_the_load_runs_without_the_cyclic_collector_and_reports_its_phases(tmp_path,
                                                                           monkeypatch):
    """No full collection of the trainer's heap in the middle of a load: the collector is off
    while megatron-core loads (seen from inside the reader) and on again afterwards; CPU targets
    have no host-to-device phase, and the phases add up to no more than the load."""
    import gc

    from megatron_ckpt_ext.backend import direct_read

    _save(tmp_path, [1])
    seen = []
    real = direct_read.item_layout
    monkeypatch.setattr(direct_read, "item_layout",
                        lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    assert gc.isenabled()
    _load(tmp_path)
    assert seen and not any(seen), seen
    assert gc.isenabled()
    with Checkpointer(CkptOptions()) as ck:
        ck.load(sharded(0, 1, {k: torch.zeros_like(v) for k, v in _state(0).items()}), tmp_path)
        report = ck.load_reports[-1]
    phases = report["phases"]
    assert phases["h2d_s"] == 0 and phases["read_s"] > 0 and phases["metadata_s"] > 0, phases
    assert sum(phases.values()) <= report["load_s"] * 1.01 + 1e-3, report


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_byte_flip_and_truncation_in_every_file_kind_is_caught(tmp_path, mode):
    """Single-byte changes at random offsets (and the first and last byte) and truncations to a
    random length, in each file of a checkpoint of each save mode (data, torch DCP's .metadata,
    common.pt, metadata.json, the manifest itself): `verify` exits 1 every time, and a load
    with verification (the default) refuses every one it is given."""
    import random

    from megatron_ckpt_ext import verify_cli

    _save(tmp_path, [1], **MODES[mode])
    checkpoint = tmp_path / "iter_0000001"
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    kinds = {p.suffix or p.name for p in files}
    # common.pt on megatron-core 0.16; 0.19 keeps the common state inside the .distcp file
    assert {".distcp", ".metadata", ".json"} <= kinds, kinds
    rng = random.Random(f"{mode}-22")
    missed = []
    for path in files:
        raw = path.read_bytes()
        offsets = {0, len(raw) - 1, *(rng.randrange(len(raw)) for _ in range(12))}
        damages = [(f"byte {o}", raw[:o] + bytes([raw[o] ^ rng.randrange(1, 256)]) + raw[o + 1:])
                   for o in sorted(offsets)]
        damages += [(f"cut to {n}", raw[:n]) for n in {0, rng.randrange(len(raw))}]
        for what, damaged in damages:
            path.write_bytes(damaged)
            if verify_cli.run(str(checkpoint)) != 1:
                missed.append(f"{path.name}: {what}")
        path.write_bytes(raw)
    assert not missed, missed
    assert verify_cli.run(str(checkpoint)) == 0
    for path in files:  # the load refuses too (one damage per file: the load is slower)
        raw = path.read_bytes()
        o = rng.randrange(len(raw))
        path.write_bytes(raw[:o] + bytes([raw[o] ^ 0x5A]) + raw[o + 1:])
        with pytest.raises(CheckpointIntegrityError, match=path.name):
            _load(tmp_path)
        path.write_bytes(raw)
    assert torch.equal(_load(tmp_path)["w"], _state(1)["w"])
