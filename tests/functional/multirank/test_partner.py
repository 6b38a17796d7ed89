"""Partner copies (--ckpt-memory-partner): two ranks, each standing for a node of its own (its own
shared-memory directory). A job killed after a committed save leaves each rank's snapshot sealed
on its node and a copy sealed on the other; after one node's memory is lost, the restarted job
fetches that node's snapshot back from the copy and restores from memory, bit-exact; a damaged
copy or none reads storage."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from megatron_ckpt_ext.staging.partner import replica_path
from megatron_ckpt_ext.staging.retained import read_seal

from . import _partner_workers as w
from tests._support.dist import run_ranks, world
from tests._support.seals import flip_byte

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

OPTIONS = {"async_save": True, "async_ckpt_use_cpu_shm": True, "use_persistent_ckpt_worker": True,
           "ckpt_assume_constant_structure": True, "ckpt_memory_partner": True}


@pytest.fixture
def nodes():
    path = Path("/dev/shm") / f"mcxtest_partner_{uuid.uuid4().hex[:8]}"
    for r in range(world()):
        (path / f"node{r}").mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _lose_node(nodes: Path, rank: int) -> None:
    """The node of ``rank`` is replaced: its shared memory (its seal, segments and the copies
    it held for others) is gone."""
    shutil.rmtree(nodes / f"node{rank}")
    (nodes / f"node{rank}").mkdir()


def _reports(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"restore{r}.json").read_text()) for r in range(world())]


def test_a_lost_node_restores_from_its_partner_copy_bit_exact(nodes, tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(w.save_and_die, args=(str(root), str(nodes), OPTIONS, 2))
    copy = read_seal(replica_path(w.node_dir(str(nodes), 1), root, 0))
    assert copy.iteration == 2 and copy.replica_of.endswith("node0")
    # admission counts each rank's staging and the partner's copy its node holds; the two
    # simulated nodes share this host, whose admission counts both ranks
    admission = json.loads((nodes / "admission0.json").read_text())
    assert admission["node_staging_bytes"] == world() * 2 * copy.nbytes
    _lose_node(nodes, 0)
    run_ranks(w.restore, args=(str(root), str(nodes), OPTIONS, 2, str(tmp_path)))
    reports = _reports(tmp_path)
    for r, rep in enumerate(reports):
        assert rep["report"]["tier"] == "memory" and rep["report"]["verified"], rep
        fetch = rep["report"]["memory_detail"].get("partner_fetch")
        if r == 0:  # its node lost its seal: fetched from the copy on node 1
            assert fetch["ok"] and fetch["from"].endswith("node1") and fetch["bytes"] > 0
        else:
            assert fetch is None
        assert rep["stats"]["partner_copies"] >= 1 and rep["stats"]["partner_iteration"] == 9
    # a clean close frees each rank's snapshot and the copy its node held for the other
    assert [os.listdir(w.node_dir(str(nodes), r)) for r in range(world())] == [[]] * world()


def test_without_partner_copies_a_lost_node_reads_storage(nodes, tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(w.save_and_die, args=(str(root), str(nodes), OPTIONS, 2))
    _lose_node(nodes, 0)
    options = {**OPTIONS, "ckpt_memory_partner": False}
    run_ranks(w.restore, args=(str(root), str(nodes), options, 2, str(tmp_path)))
    assert [rep["report"]["tier"] for rep in _reports(tmp_path)] == ["storage"] * world()


def test_a_damaged_partner_copy_is_refused_and_storage_is_read(nodes, tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(w.save_and_die, args=(str(root), str(nodes), OPTIONS, 2))
    copy = read_seal(replica_path(w.node_dir(str(nodes), 1), root, 0))
    target = next(e for e in copy.entries if e.nbytes > 64)
    flip_byte(target.path, 40)
    _lose_node(nodes, 0)
    run_ranks(w.restore, args=(str(root), str(nodes), OPTIONS, 2, str(tmp_path)))
    reports = _reports(tmp_path)
    assert [rep["report"]["tier"] for rep in reports] == ["storage"] * world()
    fetch = reports[0]["report"]["memory_detail"].get("partner_fetch")
    assert fetch is not None and not fetch["ok"] and "CRC-32" in fetch["why"]
    # nothing of the refused copy stays on node 0 (the clean close freed the rest)
    assert os.listdir(w.node_dir(str(nodes), 0)) == []
