"""The copy-ahead block's CUDA runtime calls (load/managed_block.py), through a stand-in runtime:
which prefetch signature each runtime version gets (CUDA 13 and 12.2+'s ``_v2`` take a
``cudaMemLocation`` and flags, older ones a device number), and the copies out, one
``cudaMemcpyAsync`` each, with torch's copy where the runtime refuses one. The calls themselves
run on a GPU in tests/functional/multirank/test_cuda_load.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ckpt_ext.load import managed_block


class _Runtime:
    """Records each call as (name, arguments); returns ``rc`` from the calls."""

    def __init__(self, version: int, *, v2: bool, rc: int = 0) -> None:
        self.version, self.rc, self.calls, self._v2 = version, rc, [], v2

    def __getattr__(self, name: str):
        if name == "cudaMemPrefetchAsync_v2" and not self._v2:
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            if name == "cudaRuntimeGetVersion":
                args[0]._obj.value = self.version
                return 0
            return self.rc
        return call


@pytest.mark.parametrize("version,v2,name,location", [
    (13000, False, "cudaMemPrefetchAsync", True),
    (12080, True, "cudaMemPrefetchAsync_v2", True),
    (12010, False, "cudaMemPrefetchAsync", False),
])
def test_the_prefetch_call_follows_the_runtime_version(version, v2, name, location):
    rt = _Runtime(version, v2=v2)
    assert managed_block._prefetch(rt, 0x1000, 4096, 3, 77) == 0
    called, args = rt.calls[-1]
    assert called == name
    assert args[0].value == 0x1000 and args[1].value == 4096 and args[-1].value == 77
    if location:  # (ptr, count, cudaMemLocation{device, 3}, flags 0, stream)
        assert len(args) == 5 and isinstance(args[2], managed_block._Location)
        assert (args[2].type, args[2].id, args[3]) == (managed_block._LOCATION_DEVICE, 3, 0)
    else:  # (ptr, count, device, stream)
        assert len(args) == 4 and args[2] == 3


class _Stream:
    cuda_stream = 99


@pytest.mark.parametrize("rc", [0, 1])
def test_the_copies_out_are_one_memcpy_each_and_torchs_copy_where_refused(monkeypatch, rc):
    rt = _Runtime(13000, v2=False, rc=rc)
    monkeypatch.setattr(managed_block, "_runtime", lambda: rt)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    src = torch.arange(10, dtype=torch.uint8)
    dst = [torch.zeros(4, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)]
    managed_block.copy_out([(dst[0], src[:4]), (dst[1], src[4:])], _Stream())
    copies = [args for name, args in rt.calls if name == "cudaMemcpyAsync"]
    assert [(a[0].value, a[1].value, a[2].value, a[3], a[4].value) for a in copies] == [
        (dst[0].data_ptr(), src.data_ptr(), 4, managed_block._MEMCPY_DEFAULT, 99),
        (dst[1].data_ptr(), src.data_ptr() + 4, 6, managed_block._MEMCPY_DEFAULT, 99)]
    copied = torch.cat(dst)
    assert torch.equal(copied, src if rc else torch.zeros(10, dtype=torch.uint8))
