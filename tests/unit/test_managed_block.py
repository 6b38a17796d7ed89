"""The copy-ahead block's CUDA runtime calls (load/managed_block.py), through a stand-in runtime:
which prefetch signature each runtime version gets (CUDA 13 and 12.2+'s ``_v2`` take a
``cudaMemLocation`` and flags, older ones a device number). The calls themselves run on a GPU
in tests/functional/multirank/test_cuda_load.py."""

from __future__ import annotations

import pytest

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
