"""Where a node's steady save loses to its copy floor: the same device-to-host bytes copied, with
every rank at once, into each kind of host memory the two use.

bench_ckpt.py's floor copies 1 GiB a rank in one call into ``cudaHostAlloc`` memory; our staging
copies the whole state tensor by tensor into ``/dev/shm`` segments of their own, each registered
with ``cudaHostRegister``. At 8 ranks x 8 GiB on four H100s the steady save took 1.22x that floor
(docs/node/README.md, sixteenth session) while a rank a GPU takes 1.03-1.05x. This probe times,
in alternating rounds (every rank started by one barrier, the slowest rank's seconds):

* ``pinned_1gib``: the floor as bench_ckpt.py measures it (one 1 GiB copy);
* ``pinned_full``: the whole state, tensor by tensor, into slices of one pinned buffer;
* ``shm_pieces``: the whole state, tensor by tensor, into registered ``/dev/shm`` segments, one a
  tensor (what the staging does, without any of its code);
* ``shm_pieces_thp``: the same with ``madvise(MADV_HUGEPAGE)`` on each mapping before its pages
  are touched, where the host's ``shmem_enabled`` lets a mapping ask (else left out, said why).

It also records the host's NUMA nodes, the GPU's node and on which nodes each buffer's pages
lie (``/proc/self/numa_maps``).

    torchrun --nproc-per-node 8 benchmarks/probe_d2h_targets.py --gib 7.91 --json $OUT/d2h.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _bench_node as node  # noqa: E402
from benchmarks._bench_modes import build_state, gpt_shape  # noqa: E402

_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def numa_of(ptr: int) -> dict[str, int]:
    """Pages of the mapping holding ``ptr`` on each NUMA node (``/proc/self/numa_maps``)."""
    start = None
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            start = lo
            break
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        if start is not None and int(line.split()[0], 16) == start:
            return {f"N{n}": int(c) for n, c in re.findall(r"\bN(\d+)=(\d+)", line)}
    return {}


class ShmPieces:
    """One registered /dev/shm segment per tensor, as the staging makes them."""

    def __init__(self, sizes: list[int], tag: str, huge: bool, register: bool) -> None:
        self.paths, self.maps, self.views = [], [], []
        for i, n in enumerate(sizes):
            path = f"/dev/shm/mcx_probe_{tag}_{os.getpid()}_{i}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, n)
                m = mmap.mmap(fd, n)
            finally:
                os.close(fd)
            if huge:
                m.madvise(mmap.MADV_HUGEPAGE)
            t = torch.frombuffer(m, dtype=torch.uint8)
            t.fill_(0)  # every page touched (fallocate's cost is the staging's first save)
            if register and int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)) != 0:
                raise RuntimeError(f"cudaHostRegister of {n} bytes failed")
            self.paths.append(path)
            self.maps.append(m)
            self.views.append(t)
        self.registered = register

    def close(self) -> None:
        for t in self.views:
            if self.registered:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self.views.clear()
        for m in self.maps:
            m.close()
        for p in self.paths:
            os.unlink(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0, help="state per rank (bench_ckpt's GPT)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--floor-gib", type=float, default=1.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", required=True)
    node.add_ranks_per_device(p)
    a = p.parse_args(argv)
    layout = node.init(a.device, a.ranks_per_device, 10)
    device = node.device_of(layout)
    cuda = device.type == "cuda"
    ctl = node.Ctl()
    state = build_state(gpt_shape(a.gib * 2**30), device=device, rank=dist.get_rank())
    src = [v.view(-1).view(torch.uint8) for v in state.values()]
    sizes = [t.numel() for t in src]
    total = sum(sizes)
    floor_n = min(int(a.floor_gib * 2**30), total)
    flat = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    targets: dict[str, list[torch.Tensor]] = {"pinned_1gib": [flat[:floor_n]]}
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    targets["pinned_full"] = [flat[o:o + n] for o, n in zip(offs, sizes)]
    shm = ShmPieces(sizes, "plain", huge=False, register=cuda)
    targets["shm_pieces"] = shm.views
    thp = _read(_THP)
    huge = None
    if thp and ("[advise]" in thp or "[always]" in thp or "[within_size]" in thp):
        huge = ShmPieces(sizes, "thp", huge=True, register=cuda)
        targets["shm_pieces_thp"] = huge.views
    floor_src = src[0].new_empty(floor_n)

    def copy(name: str) -> None:
        dsts = targets[name]
        if name == "pinned_1gib":
            dsts[0].copy_(floor_src, non_blocking=cuda)
        else:
            for s, d in zip(src, dsts):
                d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)

    for name in targets:  # a warm-up each (first-touch, IOMMU mappings) outside the clock
        copy(name)
    rounds: dict[str, list[list[float]]] = {name: [] for name in targets}
    for _ in range(a.rounds):
        for name in targets:
            ctl.barrier()
            t0 = time.perf_counter()
            copy(name)
            rounds[name].append(ctl.gather(time.perf_counter() - t0))
    where = {"pinned_full": numa_of(flat.data_ptr()),
             "shm_pieces_first": numa_of(shm.views[0].data_ptr()),
             "shm_pieces_largest": numa_of(shm.views[sizes.index(max(sizes))].data_ptr())}
    if huge is not None:
        where["shm_pieces_thp_largest"] = numa_of(huge.views[sizes.index(max(sizes))].data_ptr())
    pci = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        bus = getattr(props, "pci_bus_id", None)
        dom = getattr(props, "pci_domain_id", 0)
        dev = getattr(props, "pci_device_id", 0)
        if bus is not None:
            pci = f"{dom:04x}:{bus:02x}:{dev:02x}.0"
    mine = {"rank": dist.get_rank(), "device": str(device), "pci": pci,
            "gpu_numa_node": _read(f"/sys/bus/pci/devices/{pci}/numa_node") if pci else None,
            "affinity_cores": len(os.sched_getaffinity(0)), "pages_by_node": where}
    ranks = ctl.gather(mine)
    if dist.get_rank() == 0:
        out = {"schema": "megatron-ckpt-ext/probe_d2h_targets/1",
               "command": node.command_line(layout), "device": node.describe_device(device),
               "world_size": layout.world_size, "ranks_per_device": layout.ranks_per_device,
               "layout": node.layout_json(layout), "bytes_per_rank": total,
               "floor_bytes_per_rank": floor_n, "tensors_per_rank": len(sizes),
               "torch": torch.__version__, "shmem_enabled": thp,
               "numa_nodes": {p.name: _read(str(p / "cpulist")) for p in
                              sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))},
               "ranks": ranks, "rounds": {}, "summary": {}}
        for name, rs in rounds.items():
            n = floor_n if name == "pinned_1gib" else total
            slowest = [max(r) for r in rs]
            out["rounds"][name] = [node.spread(r) for r in rs]
            out["summary"][name] = {
                "slowest_rank_gbps_best": round(n / min(slowest) / 1e9, 3),
                "slowest_rank_gbps_median": round(n / statistics.median(slowest) / 1e9, 3)}
        base = out["summary"]["pinned_1gib"]["slowest_rank_gbps_best"]
        for name, s in out["summary"].items():
            s["seconds_for_state_over_floor"] = round(base / s["slowest_rank_gbps_median"], 3)
        if huge is None:
            out["summary"]["shm_pieces_thp"] = f"left out: shmem_enabled is {thp!r}"
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(json.dumps(out["summary"]), flush=True)
    shm.close()
    if huge is not None:
        huge.close()
    ctl.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
