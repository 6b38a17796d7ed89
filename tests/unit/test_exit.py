"""A trainer that leaves on its own error, without closing its Checkpointer, exits: its writers
(which ignore SIGTERM, so a job's signal cannot stop a write) are stopped at interpreter exit
instead of being waited for by multiprocessing's exit handler forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import sys, tempfile
    import torch, torch.distributed as dist
    from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0,
                            world_size=1)
    root = tempfile.mkdtemp()
    ck = Checkpointer(CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                                  use_persistent_ckpt_worker=sys.argv[1] == "persistent",
                                  ckpt_assume_constant_structure=True), save_dir=root)
    if sys.argv[2] == "save":
        st = backend.sharded_tensor_cls()
        ck.save({"w": st.from_rank_offsets("w", torch.ones(1000), replica_id=0)}, root,
                iteration=1)
    raise RuntimeError("the trainer's own error")
""")


@pytest.mark.parametrize("when", ["before-any-save", "save"])
@pytest.mark.parametrize("writer", ["persistent", "temporal"])
def test_a_trainer_leaving_on_an_error_exits_with_its_error(writer, when):
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, writer, when], capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the trainer did not exit within 90 s of its error: its writers were "
                    "waited for at exit")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the trainer's own error" in done.stderr
