"""The load benchmark's CPU smoke run (benchmarks/bench_load.py --cpu-smoke), at one rank and at 4
ranks sharing the host: the JSON has the documented fields, every source loads the saved state
bit-exact, ours verifies, every rank's load is timed. No timing is asserted (shared CI cores)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests._support.jobs import run_job

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.functional
def test_load_benchmark_smoke(tmp_path):
    out = tmp_path / "load.json"
    # as a plain script (a world of one), as the README shows it; torchrun works alike
    run_job([sys.executable, str(ROOT / "benchmarks" / "bench_load.py"),
                    "--cpu-smoke", "--repeats", "1", "--out", str(tmp_path / "ckpt"),
                    "--json", str(out)], cwd=ROOT)
    data = json.loads(out.read_text())
    assert {"device", "versions", "floors", "runs"} <= set(data)
    assert set(data["floors"]) == {"h2d_pinned_gbps", "read_warm_gbps", "read_cold_gbps",
                                   "read_h2d_warm_gbps"}
    assert data["floors"]["read_warm_gbps"] > 0 and data["floors"]["read_cold_gbps"] > 0
    # the host's own read-and-copy loop, beside the floors and the targets
    assert data["floors"]["read_h2d_warm_gbps"] > 0
    assert data["targets"]["warm_gbps_over_read_h2d"] > 0
    runs = data["runs"]
    assert {(r["source"], r["cache"]) for r in runs} == {
        (s, c) for s in ("ours", "megatron", "torch_dcp") for c in ("warm", "cold")}
    assert all(r["bit_exact"] and r["state_bytes"] > 0 and r["load_s"] > 0 for r in runs), runs
    assert all(r["verified"] for r in runs if r["variant"] == "ours")
    # how long ours' read step waited for its sums, from its load report
    assert all(set(r["read_detail"]) == {"sums_wait_s", "sum_device_busy_s"}
               for r in runs if r["source"] == "ours"), runs
    assert not any(r["verified"] for r in runs if r["source"] != "ours")
    # ours reads every item directly (no item fell back to the stock unpickling)
    assert all(r["direct_items"] > 0 and r["stock_items"] == 0 for r in runs
               if r["source"] == "ours"), runs
    assert set(data["targets"]["met"]) == {"warm >= 0.8 x floor", "warm >= 4x megatron",
                                           "cold >= 0.8 x floor", "verify <= 10% of warm",
                                           "warm: no rank > 1.2x the median"}
    assert data["world_size"] == 1 and data["command"].startswith("python ")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plot_load import throughputs

    assert set(throughputs(data)) == {(r["variant"], r["cache"]) for r in runs}


@pytest.mark.functional
@pytest.mark.timeout(200)
def test_load_benchmark_with_four_ranks_sharing_the_host(tmp_path):
    """4 ranks (--ranks-per-device 4): every load timed on every rank, started together; the
    floors read every rank's share of the files at once; the layout and command recorded."""
    out = tmp_path / "load4.json"
    run_job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "4", str(ROOT / "benchmarks" / "bench_load.py"),
                    "--cpu-smoke", "--ranks-per-device", "4", "--repeats", "1",
                    "--chunk-mib", "1",  # the storage read in 1 MiB pieces: items split
                    "--out", str(tmp_path / "ckpt"), "--json", str(out)],
                   cwd=ROOT, timeout=150)
    data = json.loads(out.read_text())
    assert data["world_size"] == 4 and data["ranks_per_device"] == 4
    assert data["layout"]["process_group"] == "gloo"
    assert data["read_chunk_mib"] == 1
    assert data["command"].startswith("torchrun --nproc-per-node 4 ")
    assert "--ranks-per-device 4" in data["command"]
    runs = data["runs"]
    # plain torch DCP loads whole tensors: it is measured at one rank only
    assert {(r["source"], r["cache"]) for r in runs} == {
        (s, c) for s in ("ours", "megatron") for c in ("warm", "cold")}
    for r in runs:
        assert len(r["per_rank_load_s"]) == 4 and min(r["per_rank_load_s"]) > 0, r
        assert r["load_s"] == max(r["per_rank_load_s"]) and r["max_over_median"] >= 1.0
        assert r["bit_exact"], r
    assert all(r["verified"] and r["direct_items"] > 0 for r in runs if r["variant"] == "ours")
    for r in runs:  # every rank's own phases, and a verifying load's steps of its check
        if r["source"] != "ours":
            continue
        assert all(len(v) == 4 for v in r["rank_phases"].values()), r
        assert max(r["rank_phases"]["read_s"]) > 0, r
        steps = r["verify_detail"]
        assert (set(steps) == {"settle_s", "check_s", "agree_s"}) == (r["variant"] == "ours"), r
        assert all(len(v) == 4 and min(v) >= 0 for v in steps.values()), r
    for sample in data["floor_samples"]:
        for what in ("read_cold_s", "read_warm_s"):
            assert len(sample[what]["per_rank"]) == 4
            assert sample[what]["max"] == max(sample[what]["per_rank"])
        on_disk = runs[0]["bytes_on_disk"]  # every rank's share: all the bytes, once
        want = on_disk / sample["read_cold_s"]["max"] / 1e9
        assert abs(sample["read_cold_gbps"] - want) <= 0.002 + 1e-3 * want, (sample, on_disk)
    assert data["targets"]["warm_max_over_median"] >= 1.0


@pytest.mark.functional
def test_memory_restore_benchmark_smoke(tmp_path):
    """bench_memory_restore.py --cpu-smoke: a killed child's snapshot is restored from memory,
    in each of two repeats (the storage loads between them must leave it alone), every load is
    bit-exact and takes the tier it should; the JSON has the documented fields."""
    out = tmp_path / "restore.json"
    run_job([sys.executable, str(ROOT / "benchmarks" / "bench_memory_restore.py"),
                    "--cpu-smoke", "--repeats", "2", "--out", str(tmp_path / "ckpt"),
                    "--json", str(out)], cwd=ROOT)
    data = json.loads(out.read_text())
    assert {"device", "versions", "world_size", "command", "floors", "runs"} <= set(data)
    assert set(data["floors"]) == {"h2d_pinned_gbps"}
    assert {(r["source"], r["tier"], r["cache"]) for r in data["runs"]} == {
        ("ours", "memory", None), ("ours", "memory", "built"), ("ours", "storage", "warm"),
        ("ours", "storage", "cold"), ("stock", "storage", "warm"), ("stock", "storage", "cold")}
    assert all(r["bit_exact"] and r["bytes"] > 0 for r in data["runs"])
    assert data["summary"]["tiers_as_expected"] and data["summary"]["all_bit_exact"]
    assert [r["tier"] for r in data["runs"] if r["expected_tier"] == "memory"] == ["memory"] * 4
    for r in data["runs"]:  # "built": the load found every buffer summed, and did not wait
        if r["cache"] == "built":
            detail = r["memory_detail"]
            assert detail["summed_ahead"] > 0 and detail["prepare_wait_s"] < 0.05, detail
    assert data["summary"]["memory_built_s"] > 0


@pytest.mark.functional
def test_partner_benchmark_smoke(tmp_path):
    """bench_partner.py --cpu-smoke under torchrun (two ranks as two nodes): a round without and
    with partner copies, each copy sealed on the partner, twice the node memory with copies;
    the restores bit-exact, the one after node 0's loss from memory with rank 0's copy
    fetched."""
    out = tmp_path / "partner.json"
    run_job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(ROOT / "benchmarks" / "bench_partner.py"),
                    "--cpu-smoke", "--out", str(tmp_path / "ckpt"), "--json", str(out)],
                   cwd=ROOT)
    data = json.loads(out.read_text())
    assert {"device", "versions", "world_size", "command", "rounds", "restores",
            "summary"} <= set(data) and data["world_size"] == 2
    summary = data["summary"]
    assert summary["copy_median_s"] > 0
    assert 1.9 < summary["node_bytes"]["on"] / summary["node_bytes"]["off"] < 2.1
    restores = {r["case"]: r for r in data["restores"]}
    assert all(r["bit_exact"] for r in restores.values())
    assert restores["memory, both nodes"]["tier"] == "memory"
    assert restores["memory, both nodes"]["partner_fetch"] is None
    lost = restores["memory, node 0 lost"]
    assert lost["tier"] == "memory" and lost["partner_fetch"]["ok"], lost
    assert restores["storage, warm"]["tier"] == restores["storage, cold"]["tier"] == "storage"


@pytest.mark.functional
def test_load_benchmark_times_only_the_sources_and_caches_asked(tmp_path):
    """--caches warm: no cold load and no cold floor (a cold pass over a node's checkpoint costs
    minutes); --load-threads 2 3: ours with each in turn, the other sources once, each run naming
    its threads, the targets the first value's and each value's beside them."""
    out = tmp_path / "load.json"
    run_job([sys.executable, str(ROOT / "benchmarks" / "bench_load.py"), "--cpu-smoke",
                    "--repeats", "1", "--sources", "ours", "megatron", "--caches", "warm",
                    "--load-threads", "2", "3",
                    "--out", str(tmp_path / "ckpt"), "--json", str(out)],
                   cwd=ROOT)
    data = json.loads(out.read_text())
    assert [(r["variant"], r["cache"], r["load_threads"]) for r in data["runs"]] == [
        ("ours", "warm", 2), ("megatron", "warm", None), ("ours", "warm", 3)]
    assert all(r["bit_exact"] for r in data["runs"])
    assert data["floors"]["read_cold_gbps"] is None and data["floors"]["read_warm_gbps"] > 0
    assert all(s["read_cold_s"] is None for s in data["floor_samples"])
    first = data["first_load"]  # the process's first load, apart from the repeats
    assert (first["variant"], first["cache"], first["repeat"]) == ("ours", "warm", -1)
    assert first["load_s"] > 0 and first["bit_exact"] and first["load_threads"] == 2
    assert data["threads_per_rank"]["load_read"] == 2
    assert set(data["targets"]["met"]) == {"warm >= 0.8 x floor", "warm >= 4x megatron",
                                           "warm: no rank > 1.2x the median"}
    by = data["by_load_threads"]
    assert set(by) == {"2", "3"}
    assert by["2"] == {k: v for k, v in data["targets"].items() if k != "warm_gbps_over_read_h2d"}
    ours3 = [r["load_s"] for r in data["runs"] if r["load_threads"] == 3][0]
    megatron = data["runs"][1]["load_s"]
    assert by["3"]["warm_speedup_over_megatron"] == round(megatron / ours3, 3)


@pytest.mark.functional
def test_memory_restore_benchmark_times_only_the_cases_asked(tmp_path):
    """--cases ours-memory ours-storage-warm (the A/B runs): each repeat times those two loads
    and no other."""
    out = tmp_path / "restore.json"
    run_job([sys.executable, str(ROOT / "benchmarks" / "bench_memory_restore.py"),
                    "--cpu-smoke", "--repeats", "2", "--cases", "ours-memory",
                    "ours-storage-warm", "--out", str(tmp_path / "ckpt"), "--json", str(out)],
                   cwd=ROOT)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["source"], r["expected_tier"], r["cache"]) for r in runs] == [
        ("ours", "memory", None), ("ours", "storage", "warm")] * 2
    assert [r["tier"] for r in runs] == ["memory", "storage"] * 2


def test_load_targets_leave_out_what_a_subset_did_not_run():
    """--sources ours ours_no_verify --caches warm (the A/B runs): the ratios of what ran, the
    checks of what did not run left out, not failed and not crashing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_load

    def run(variant, load_s):
        return {"variant": variant, "cache": "warm", "load_s": load_s, "bytes_on_disk": 10 * 10**9,
                "max_over_median": 1.0}

    got = bench_load.targets([run("ours", 1.1), run("ours_no_verify", 1.0)],
                             {"h2d_pinned_gbps": 20.0, "read_warm_gbps": 10.0,
                              "read_cold_gbps": 2.0})
    assert got["verify_cost_warm"] == 0.1 and got["warm_gbps_over_floor"] == round(1 / 1.1, 3)
    assert got["warm_speedup_over_megatron"] is None and got["cold_gbps_over_floor"] is None
    assert set(got["met"]) == {"warm >= 0.8 x floor", "verify <= 10% of warm",
                               "warm: no rank > 1.2x the median"}
    args = bench_load.parse_args(["--json", "x", "--sources", "ours", "--caches", "warm"])
    assert (args.sources, args.caches) == (["ours"], ["warm"])
    with pytest.raises(SystemExit):
        bench_load.parse_args(["--json", "x", "--sources", "nobody"])


def test_the_hosts_own_read_and_copy_moves_every_byte_of_odd_sized_files(tmp_path):
    """read_h2d_s (the read-and-copy floor) reads every piece of every file, the short last
    piece of a file included, over more threads than pieces too; a lost piece raises."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_load
    import torch

    chunk = bench_load._CHUNK
    files = []
    for i, n in enumerate((chunk * 2 + 7, 1, chunk - 1)):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * n)
        files.append(path)
    for threads in (1, 3, 8):
        assert bench_load.read_h2d_s(files, threads, torch.device("cpu")) > 0
    with pytest.raises(RuntimeError, match="moved"):
        bench_load.read_h2d_s(files + [tmp_path / "f0"], 2, torch.device("cpu"),
                              ready=lambda: (tmp_path / "f0").write_bytes(b"x" * (chunk * 4)))


@pytest.mark.functional
def test_load_variants_probe_applies_each_variant_and_loads_exact(tmp_path):
    """benchmarks/probe_load_variants.py (the reading threads, chunk, copies in flight and switch
    interval of a load varied in one process): each variant's settings are the ones its loads
    ran with, and every load is bit-exact (the probe exits non-zero otherwise)."""
    out = tmp_path / "variants.json"
    run_job([sys.executable, str(ROOT / "benchmarks" / "probe_load_variants.py"),
                    "--cpu-smoke", "--repeats", "1", "--loop-chunks", "32",
                    "--variants", "T2_C32_F1", "T2_C64_F2_S500", "--out", str(tmp_path / "ckpt"),
                    "--json", str(out)], cwd=ROOT)
    data = json.loads(out.read_text())
    assert set(data["host_loops_s"]) == {"T8_C32", "T16_C32"}
    applied = {x["variant"]: x["applied"] for x in data["loads"]}
    assert applied == {
        "T2_C32_F1": {"chunk_mib": 32, "in_flight": 1, "switch_us": 5000},
        "T2_C64_F2_S500": {"chunk_mib": 64, "in_flight": 2, "switch_us": 500}}
    assert len(data["loads"]) == 2 * 2 * 2  # two blocks a variant, verifying and not
    assert set(data["summary"]) == {f"{v}_{k}" for v in applied for k in ("verify", "plain")}


@pytest.mark.functional
@pytest.mark.parametrize("bench,extra", [("bench_load.py", ["--json", "{tmp}/l.json"]),
                                         ("bench_ckpt.py", []),
                                         ("bench_memory_restore.py", ["--json", "{tmp}/m.json"]),
                                         ("bench_partner.py", ["--json", "{tmp}/p.json"])])
def test_a_checkpoint_root_that_cannot_be_written_is_one_line_naming_out(tmp_path, bench, extra):
    """--out where nothing can be written (under a regular file): one line naming --out and
    the fix, before any process group or state (it was every rank's traceback from the save)."""
    import subprocess

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / bench), "--cpu-smoke",
                           "--out", str(blocker / "ckpt"),
                           *[a.format(tmp=tmp_path) for a in extra]],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"--out {blocker / 'ckpt'}: cannot be written") and \
        "point --out at a writable directory" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
