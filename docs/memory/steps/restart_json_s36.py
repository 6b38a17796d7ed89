"""Builds docs/memory/h200_restart_s36.json (issue 32's schema, as h200_restart_s35.json) from
the thirty-sixth session's real-client results, adding what a restart leaves to the first two
training steps (Megatron's elapsed time per iteration, from the runs' logs). From the
repository root: python docs/memory/steps/restart_json_s36.py"""

import json
import re
import tarfile

RC = "docs/megatron_lm/real_client"
CALLS = {"call2": ("h200_134m_s36", "134M", "OUT=$OUT LABEL=s36 BUDGET=530 bash "
                   "docs/megatron_lm/steps/recheck_s18.sh  # carry .whl .mlm"),
         "call3": ("h200_1b_s36_ours", "1B", "OUT=$OUT SOURCES=ours KILL=1 LABEL=s36_ours "
                   "BUDGET=520 bash docs/megatron_lm/steps/run_1b_s22.sh  # carry .whl .mlm")}


def logs(name):
    with tarfile.open(f"{RC}/{name}_logs.tgz") as tar:
        return {m.name.rsplit("/", 1)[-1][:-4]: tar.extractfile(m).read().decode(errors="replace")
                for m in tar.getmembers() if m.name.endswith(".log")}


def main():
    out = {"device": "NVIDIA H200", "world_size": 1, "versions": None, "command": {},
           "code": "0c1d18c (the pinning of a restored snapshot left to the first step's "
                   "prepare(), unpaced: the pacing, MCX_PIN_PACE, is the default since 6ac9011)",
           "floors": {}, "runs": [], "notes": []}
    for call, (name, model, command) in CALLS.items():
        data, texts = json.load(open(f"{RC}/{name}.json")), logs(name)
        out["versions"] = data["versions"] | {"Megatron-LM": "core_r0.19.0 pretrain_gpt.py"}
        out["command"][call] = command
        floors = next(iter(data["floors"].values()))
        out["floors"][f"{call}_h2d_pinned_gbps"] = floors["h2d_pinned_gbps"]
        for load in data["loads"]:
            if load["kind"] == "kill" or load["source"] != "ours" and load["kind"] == "restart":
                continue
            text = texts.get(load["run"], "")
            reports = [json.loads(l.split("checkpoint load report: ", 1)[1])
                       for l in text.splitlines() if "checkpoint load report: " in l]
            steps = [float(v) for v in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                                  text)][:2]
            row = {"source": load["source"], "tier": load["tier"] or "storage",
                   "cache": {"resume_cold": "cold", "resume_warm": "warm"}.get(load["kind"]),
                   "bytes": floors["checkpoint_bytes"], "load_s": load["load_s"], "model": model,
                   "run": load["run"], "call": call, "first_two_steps_ms": steps}
            if reports:
                row["our_load_s"] = reports[-1]["load_s"]
                row["megatron_part_s"] = round(load["load_s"] - reports[-1]["load_s"], 4)
            out["runs"].append(row)
    out["floors"]["h2d_pinned_gbps"] = min(v for k, v in out["floors"].items()
                                           if k.endswith("_h2d_pinned_gbps"))
    out["notes"] = [
        "load_s: Megatron's load-checkpoint timer; our_load_s: our load report's load_s; "
        "megatron_part_s: the difference; first_two_steps_ms: Megatron's elapsed time of the "
        "first two iterations after the load",
        "restart: kill -9 of every process after the commit of 200 (134M) / 400 (1B), relaunch; "
        "restart_storage: the same checkpoint copied, loaded warm with the memory tier off",
        "the restore from memory copies the snapshot to the device ahead, during Megatron's "
        "initialisation (the default since the thirty-first session): the timer holds the rest",
        "losses after both restarts identical to the uninterrupted runs (134M 201-350, 1B 401-600)"]
    with open("docs/memory/h200_restart_s36.json", "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
