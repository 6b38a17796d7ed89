"""``python -m megatron_ckpt_ext shm list``: for each sealed snapshot the node holds, whose it is
(save root, iteration, rank layout, the sealing process and host), how large and how old, how
many of its segments are there, and whether a running job maps it; then the totals."""

from __future__ import annotations

import gc
import os
import re
import socket

import torch

from megatron_ckpt_ext import shm_cli
from megatron_ckpt_ext.staging.retained import read_seal, seal_path
from megatron_ckpt_ext.staging.shm import ShmStager


def _seal(tmp_path, root) -> None:
    """A snapshot of iteration 3 (1.25 M float32 + 300 bfloat16: 5.0 MB), sealed and left by a
    stager closed for a planned restart (its segments unmapped, the seal kept)."""
    stager = ShmStager(job_id="lister", rank=1, reuse=True, pin=False, shm_dir=str(tmp_path),
                       sweep=False)
    state = [torch.arange(1_250_000, dtype=torch.float32), torch.ones(300, dtype=torch.bfloat16)]
    batch = stager.stage(state, keys=["w", "b"])
    layout = [("w", [0], [1_250_000], "torch.float32"), ("b", [0], [300], "torch.bfloat16")]
    stager.seal(batch, root=str(root), iteration=3, world=2, layout=layout, manifest_crc32="1")
    stager._seal_thread.join()
    del batch
    stager.close(keep_sealed=True)
    gc.collect()


def test_shm_list_names_owner_size_age_segments_and_use(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _seal(tmp_path, root)
    assert shm_cli.run("list", shm_dir=str(tmp_path)) == 0
    line, total = capsys.readouterr().out.splitlines()[:2]
    want = (rf"^{re.escape(os.path.realpath(root))}  iteration 3  rank 1/2  5\.0 MB  age \d+ s  "
            rf"sealed by pid {os.getpid()} on {re.escape(socket.gethostname())}  segments 2/2$")
    assert re.match(want, line), line
    assert total.startswith("1 sealed snapshot(s), 5.0 MB; 0 other segment(s) of ours"), total

    seal = read_seal(seal_path(str(tmp_path), root, 1))
    os.unlink(seal.entries[1].path)  # a segment lost (a /dev/shm cleaned by hand)
    other = ShmStager(job_id="reader", rank=1, reuse=True, pin=False, shm_dir=str(tmp_path),
                      sweep=False)
    held = other._map(seal.entries[0])  # a running job maps the other one
    shm_cli.run("list", shm_dir=str(tmp_path))
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("segments 1/2  in use (a running job maps it)"), line
    del held
    other.close()
