"""The checkpoint benchmark's CPU smoke run (benchmarks/bench_ckpt.py --cpu-smoke, 2 gloo ranks):
the JSON has the documented schema, every mode either has one record per save or a recorded
reason, byte counts match the state, and our checkpoints load back bit-exact. A 4-rank run
sharing the host (--ranks-per-device 4) records the layout, every rank's figures and floors
measured with every rank at once. No timing is asserted (shared CI cores)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests._support.jobs import run_job

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _bench_modes as bm  # noqa: E402

SAVES = 2
RECORD_KEYS = {"mode", "source", "cpu_shm", "state_bytes", "save_index", "blocking_s",
               "durable_s", "host_extra_bytes", "staging_done_s"}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bench_ckpt.py"), "--cpu-smoke", "--saves", str(SAVES),
           "--out", str(out / "ckpt"), "--json", str(out / "bench.json"), "--mem-sample-s", "0.2"]
    r = run_job(cmd, cwd=ROOT)
    assert "[bench" in r.stdout and "save 1/2" in r.stdout  # progress lines, rank 0
    assert not (out / "ckpt" / bm.MODES[0].name).exists()  # checkpoints deleted after each mode
    return json.loads((out / "bench.json").read_text())


def _expected_bytes() -> int:
    """Per-rank bytes of the smoke state, computed without building it."""
    shape = bm.GptShape(*bm.SMOKE_SHAPE)
    return shape.params() * bm.BYTES_PER_PARAM


@pytest.mark.functional
@pytest.mark.timeout(450)
def test_json_has_the_schema(result):
    assert {"device", "versions", "floors", "runs", "modes", "summary"} <= set(result)
    assert {"torch", "megatron-core", "nvrx", "python"} <= set(result["versions"])
    assert result["floors"]["d2h_pinned_gbps"] > 0 and result["floors"]["write_gbps"] > 0
    assert result["world"] == 2
    for record in result["runs"]:
        assert RECORD_KEYS <= set(record), sorted(RECORD_KEYS - set(record))
        assert record["source"] in ("ours", "megatron", "torch_dcp")
        assert 0 < record["blocking_s"] <= record["staging_done_s"] + 1e-6


@pytest.mark.functional
@pytest.mark.timeout(450)
def test_the_copy_floor_moves_the_states_own_bytes(result):
    """--floor-gib state (the default): the floor each record divides by copied that size's
    bytes, every rank at once; the up-front sample stands beside it under its own name."""
    f = result["floors"]
    assert f["d2h_floor_size"] == "state"
    (size, d2h), = result["d2h_floor_by_size"].items()
    assert d2h["d2h_bytes_per_rank"] == _expected_bytes() and len(d2h["d2h_per_rank_gbps"]) == 2
    assert f["d2h_pinned_gbps"] == d2h["d2h_pinned_gbps"] == min(d2h["d2h_per_rank_gbps"])
    assert f["d2h_sample_bytes_per_rank"] == int(2**30 / 64) and f["d2h_sample_pinned_gbps"] > 0
    (_, write), = result["write_floor_by_size"].items()
    assert f["write_gbps"] == write["gbps"] and f["write_floor_size"] == "state"
    for r in result["runs"]:
        assert r["size"] == size
        assert abs(r["floor_d2h_s"] - r["state_bytes"] / (d2h["d2h_pinned_gbps"] * 1e9)) < 2e-6
        want = r["state_bytes"] * 2 / (write["gbps"] * 1e9)  # both ranks' bytes
        assert abs(r["floor_write_s"] - want) < 2e-6


def test_floor_size_takes_gib_or_state():
    import bench_ckpt

    assert bench_ckpt.parse_args([]).floor_gib == "state"
    assert bench_ckpt.parse_args([]).floor_write_gib == "state"
    assert bench_ckpt.parse_args(["--floor-write-gib", "2"]).floor_write_gib == 2.0
    assert bench_ckpt.parse_args(["--floor-gib", "0.5"]).floor_gib == 0.5
    for bad in ("0", "-1", "big"):
        with pytest.raises(SystemExit):
            bench_ckpt.parse_args(["--floor-gib", bad])


@pytest.mark.functional
@pytest.mark.timeout(450)
def test_every_mode_saved_every_time_or_says_why_not(result):
    modes = {m["mode"]: m for m in result["modes"]}
    assert set(modes) == {m.name for m in bm.MODES}
    for name, mode in modes.items():
        indices = sorted(r["save_index"] for r in result["runs"] if r["mode"] == name)
        if mode["status"] == "skipped":
            assert mode["reason"] and indices == [], mode
        else:
            assert mode["status"] == "ok", mode
            assert indices == list(range(1, SAVES + 1)), (name, indices)
    for spec in bm.MODES:  # ours, stock sync/temporal and DCP's default run on any backend
        if spec.source == "ours" or spec.worker in ("sync", "temporal") or (
                spec.source == "torch_dcp" and spec.stager is None):
            assert modes[spec.name]["status"] == "ok", modes[spec.name]


@pytest.mark.functional
@pytest.mark.timeout(450)
def test_bytes_match_the_state(result):
    want = _expected_bytes()
    assert {r["state_bytes"] for r in result["runs"]} == {want}
    for r in result["runs"]:
        if r["source"] == "ours":
            assert r["report"]["bytes"] == want and r["report"]["bytes_total"] == 2 * want


@pytest.mark.functional
@pytest.mark.timeout(450)
def test_our_checkpoints_load_back_bit_exact(result):
    ours = [m for m in result["modes"] if m["source"] == "ours"]
    assert ours and all(m.get("verified_bit_exact") is True for m in ours), ours


@pytest.mark.functional
@pytest.mark.timeout(450)
def test_summary_covers_the_runs(result):
    summary = result["summary"]
    [table] = summary["per_size"].values()
    for name, row in table.items():
        assert row["saves"] == SAVES and len(row["blocking_first3_s"]) == SAVES, name
    assert {r["ours"] for r in summary["ratios"]} == {m.name for m in bm.MODES if m.source == "ours"}


FOUR_MODES = ("ours-async-persistent-cpu-shm", "ours-sync")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    """4 ranks sharing the host (--ranks-per-device 4), the recommended mode and the sync one."""
    out = tmp_path_factory.mktemp("bench4")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "benchmarks" / "bench_ckpt.py"), "--cpu-smoke", "--saves", str(SAVES),
           "--ranks-per-device", "4", "--modes", *FOUR_MODES, "--out", str(out / "ckpt"),
           "--json", str(out / "bench.json"), "--mem-sample-s", "0.2"]
    run_job(cmd, timeout=150, cwd=ROOT)
    return json.loads((out / "bench.json").read_text())


@pytest.mark.functional
@pytest.mark.timeout(200)
def test_four_ranks_record_the_layout_and_the_command(four_ranks):
    r = four_ranks
    assert r["world_size"] == 4 and r["ranks_per_device"] == 4 and r["world"] == 4
    assert r["layout"]["local_world_size"] == 4 and r["layout"]["process_group"] == "gloo"
    assert r["command"].startswith("torchrun --nproc-per-node 4 ")
    assert "--ranks-per-device 4" in r["command"]
    assert {"torch", "megatron-core", "nvrx"} <= set(r["versions"]) and r["device"]


@pytest.mark.functional
@pytest.mark.timeout(200)
def test_four_ranks_floors_are_measured_with_every_rank_at_once(four_ranks):
    f = four_ranks["floors"]
    assert f["all_ranks_at_once"] == 4
    assert len(f["d2h_per_rank_gbps"]) == 4 and min(f["d2h_per_rank_gbps"]) > 0
    assert f["d2h_pinned_gbps"] == min(f["d2h_per_rank_gbps"])  # the slowest rank's
    # the aggregate counts every rank's bytes over the slowest rank's time
    assert abs(f["d2h_aggregate_gbps"] - 4 * f["d2h_pinned_gbps"]) <= 0.01
    for what in ("write_seconds", "write_sample_seconds", "read_seconds"):
        assert len(f[what]["per_rank"]) == 4 and f[what]["max"] == max(f[what]["per_rank"])
    streams = f["write_streams_per_rank"]
    assert f["write_sample_bytes_total"] == 4 * streams * (int(2**30 / 32) // streams)
    # --floor-write-gib state: every rank writes its state's bytes (rounded to its streams)
    assert f["write_floor_size"] == "state"
    assert f["write_bytes_total"] == 4 * (_expected_bytes() // streams * streams)
    assert len(f["write_seconds"]["per_rank"]) == 4
    assert f["write_gbps"] > 0 and f["write_sample_gbps"] > 0 and f["read_cold_gbps"] > 0


@pytest.mark.functional
@pytest.mark.timeout(200)
def test_four_ranks_report_every_ranks_figures(four_ranks):
    runs = four_ranks["runs"]
    assert {r["mode"] for r in runs} == set(FOUR_MODES) and len(runs) == 2 * SAVES
    for rec in runs:
        per = rec["per_rank"]
        assert all(len(per[k]) == 4 for k in ("blocking_s", "durable_s", "host_extra_bytes"))
        assert rec["blocking_s"] == max(per["blocking_s"]) and min(per["blocking_s"]) > 0
        assert rec["blocking_max_over_median"] >= 1.0
        assert rec["host_extra_node_bytes"] >= rec["host_extra_bytes"]
    for name, row in four_ranks["summary"]["per_size"][runs[0]["size"]].items():
        assert len(row["per_rank_blocking_steady_s"]) == 4, name
        assert row["blocking_steady_max_over_median"] >= 1.0, name
    assert all(m["status"] == "ok" and m["verified_bit_exact"] is True
               for m in four_ranks["modes"]), four_ranks["modes"]


def test_node_memory_counts_dev_shm_once_and_every_ranks_process():
    import bench_ckpt

    peak = lambda tree, shm: bm.Peak(proc=tree + shm, tree=tree, shm=shm)  # noqa: E731
    ranks = [(0.1, 0.1, 0.5, peak(10, 1000), "a"), (0.2, 0.2, 0.6, peak(20, 1000), "a"),
             (0.1, 0.1, 0.5, peak(30, 900), "b"), (0.4, 0.4, 0.9, peak(40, 800), "b")]
    got = bench_ckpt.per_rank_figures(ranks)
    assert got["host_extra_node_bytes"] == 10 + 20 + 1000  # node a: both trees + shm once
    assert got["node_ranks"] == 2
    assert got["per_rank"]["blocking_s"] == [0.1, 0.2, 0.1, 0.4]
    assert got["blocking_max_over_median"] == round(0.4 / 0.15, 3)


def test_a_ranks_memory_split_is_taken_from_the_sample_where_its_total_peaked(monkeypatch):
    """A tree that peaks before /dev/shm fills (a rank's start-up, then its staging) must not
    be added to /dev/shm's later peak: the node figure takes each rank's tree and /dev/shm from
    the one sample where their sum peaked."""
    samples = iter([(0, 0, 0), (500, 100, 0), (40, 1000, 0), (30, 1000, 0), (30, 1000, 0)])
    monkeypatch.setattr(bm.HostMemSampler, "current", lambda self: next(samples))
    monkeypatch.setattr(bm.HostMemSampler, "_loop", lambda self: None)
    sampler = bm.HostMemSampler(3600)  # the first sample: its baseline
    for _ in range(3):
        sampler.sample()
    peak = sampler.take_peak()  # one more sample, then the peak
    assert (peak.proc, peak.tree, peak.shm) == (1040, 40, 1000)


def test_node_memory_target_compares_the_node_with_its_ranks_staging():
    """8 ranks on a node: each rank's own figure counts all of /dev/shm, so the memory target is
    the node's extra bytes against 8 ranks' staging (1.02x), not one rank's figure against one
    rank's bytes (which an 8-rank node always misses)."""
    import bench_ckpt

    def mode(node_bytes):
        return {"host_extra_max_bytes": 8 * 100, "host_extra_node_max_bytes": node_bytes,
                "node_ranks": 8, "floor_d2h_s": 1.0, "floor_write_s": 1.0}

    t = bench_ckpt._targets(mode(8 * 100 + 10), None, 100)
    assert "host_extra_le_1.05x_state" not in t
    got = t["host_node_le_1.02x_node_staged"]
    assert (got["staged_bytes"], got["ratio"], got["met"]) == (800, 1.0125, True)
    assert bench_ckpt._targets(mode(8 * 100 + 20), None, 100)[
        "host_node_le_1.02x_node_staged"]["met"] is False  # 1.025x
    one = bench_ckpt._targets({"host_extra_max_bytes": 104, "floor_d2h_s": 1.0,
                               "floor_write_s": 1.0}, None, 100)
    assert one["host_extra_le_1.05x_state"]["met"] is True  # one rank: its own figure


def test_steady_target_is_the_issues_bound_for_one_rank_and_for_a_node():
    """The steady save's bound is 1.05x the copy floor at one rank and 1.1x the all-ranks floor
    on a node of several ranks (the issues' targets), named by its factor."""
    import bench_ckpt

    def mode(steady, ranks):
        return {"blocking_steady_s": steady, "floor_d2h_s": 1.0, "floor_write_s": 1.0,
                "host_extra_max_bytes": 100, "host_extra_node_max_bytes": 100 * ranks,
                "node_ranks": ranks}

    one = bench_ckpt._targets(mode(1.06, 1), None, 100)["steady_blocking_le_1.05x_d2h_floor"]
    assert (one["bound_s"], one["met"]) == (1.05, False)
    assert bench_ckpt._targets(mode(1.04, 1), None, 100)[
        "steady_blocking_le_1.05x_d2h_floor"]["met"] is True
    node = bench_ckpt._targets(mode(1.06, 8), None, 100)["steady_blocking_le_1.1x_d2h_floor"]
    assert (node["bound_s"], node["met"]) == (1.1, True)
    assert bench_ckpt._targets(mode(1.12, 8), None, 100)[
        "steady_blocking_le_1.1x_d2h_floor"]["met"] is False


def test_ranks_per_device_layouts():
    import _bench_node as node

    def layout(device, per, local_rank=0, local_world=8, cuda=1):
        return node.resolve_layout(device, per, local_rank=local_rank, local_world=local_world,
                                   world=local_world, cuda_count=cuda)

    one_gpu = [layout("cuda", None, r) for r in range(8)]  # auto: 8 ranks on the one GPU
    assert {(x.device_index, x.ranks_per_device, x.backend) for x in one_gpu} == {(0, 8, "gloo")}
    per_gpu = [layout("cuda", None, r, cuda=8) for r in range(8)]  # auto on 8 GPUs: one each
    assert [x.device_index for x in per_gpu] == list(range(8))
    assert {(x.ranks_per_device, x.backend) for x in per_gpu} == {(1, "nccl")}
    two_each = [layout("cuda", 2, r, cuda=4) for r in range(8)]
    assert [x.device_index for x in two_each] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout("cuda", 8, 5, cuda=8).device_index == 0  # asked: all on the first GPU
    assert layout("cpu", 4, local_world=4).backend == "gloo"
    with pytest.raises(ValueError, match="--ranks-per-device 1: 8 local ranks need 8 CUDA "
                       "devices, 1 visible; pass --ranks-per-device 8"):
        layout("cuda", 1)
    with pytest.raises(ValueError, match=r"--ranks-per-device 2: on CPU the host's 4 local "
                       r"rank\(s\) share it"):
        layout("cpu", 2, local_world=4)
    assert node.parse_ranks_per_device("auto") is None and node.parse_ranks_per_device("8") == 8
    for bad in ("0", "x", "-1"):
        with pytest.raises(ValueError, match="--ranks-per-device must be 'auto' or an integer"):
            node.parse_ranks_per_device(bad)


def test_gpt_shape_comes_close_to_the_requested_size():
    for gib in (2, 4, 8):
        shape = bm.gpt_shape(gib * 2**30)
        got = shape.params() * bm.BYTES_PER_PARAM / 2**30
        assert abs(got - gib) / gib < 0.1 and shape.layers >= 4, (gib, shape, got)


def test_summary_ratios_and_flatness_from_records():
    import bench_ckpt

    def rec(mode, source, i, blocking, host):
        return {"mode": mode, "source": source, "size": "1.00GiB", "save_index": i,
                "state_bytes": 100, "blocking_s": blocking, "staging_done_s": blocking,
                "durable_s": 2 * blocking, "host_extra_bytes": host, "host_extra_sys_bytes": host,
                "floor_d2h_s": 0.1, "floor_write_s": 1.0}

    runs = [rec("megatron-async-persistent-cpu-shm", "megatron", i, b, 100)
            for i, b in enumerate([8.0, 0.8, 0.7, 0.7, 0.9], 1)]
    runs += [rec("ours-async-persistent-cpu-shm", "ours", i, b, h)
             for i, (b, h) in enumerate([(1.0, 90), (0.1, 100), (0.1, 100), (0.1, 101), (0.2, 100)], 1)]
    s = bench_ckpt.summarize(runs, [])
    row = s["per_size"]["1.00GiB"]["ours-async-persistent-cpu-shm"]
    assert row["blocking_first3_s"] == [1.0, 0.1, 0.1] and row["blocking_median_4_n_s"] == 0.15
    [ratio] = s["ratios"]
    assert ratio["first_stock_over_ours"] == 8.0 and ratio["steady_stock_over_ours"] == 7.0
    assert s["host_flatness"]["1.00GiB/ours-async-persistent-cpu-shm"]["flat_pm_1pct"] is True
    runs[-1]["host_extra_bytes"] = 110  # 10 % growth on the last save: not flat
    s = bench_ckpt.summarize(runs, [])
    assert s["host_flatness"]["1.00GiB/ours-async-persistent-cpu-shm"]["flat_pm_1pct"] is False


def test_write_path_bench_writes_each_variant_and_its_json(tmp_path):
    """benchmarks/bench_write_path.py on a tiny size: every variant measured each round, the files
    it wrote removed, and the JSON ratios computed against the raw writes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_write_path.py"
    target, out = tmp_path / "wp", tmp_path / "wp.json"
    r = subprocess.run([sys.executable, str(script), "--dir", str(target), "--gib", "0.01",
                        "--tensor-mib", "2", "--rounds", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"raw", "torch_save_crc", "torch_save_no_crc"}
    assert result["bytes"] == 5 * 2 * 2**20 and result["tensors"] == 5
    for v in result["variants"].values():
        assert len(v["seconds"]) == 2 and all(s > 0 for s in v["seconds"])
        assert v["over_raw"] == v["median_s"] / result["variants"]["raw"]["median_s"]
    assert not target.exists()
