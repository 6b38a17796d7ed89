"""--fsdp-use-symm-mem: detection, validation, wrap_fsdp, the GPU script's refusals (its FSDP
checkpoint round trip on two CPU ranks: tests/functional/multirank/test_fsdp.py).

Megatron-FSDP's experimental fully_shard (the one with ``use_symm_mem``) is in megatron-core 0.19.2,
whose top-level package does not import on this CPU machine (triton). Its ``megatron_fsdp`` package
does, on its own, from the unpacked wheel (``MCORE0192_DIR``, default ``.ext/mcore-0.19.2``, where
scripts/test.sh unpacks it): tests that need the real code run it in a subprocess with that folder
on PYTHONPATH, and are skipped where the wheel is not unpacked. ``wrap_fsdp``'s decisions are
tested against a mocked ``fully_shard``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.machinery
import json
import logging
import os
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from megatron_ckpt_ext import CkptOptions, CkptOptionsError, _runtime, add_arguments, backend, fsdp
from megatron_ckpt_ext.errors import BackendUnavailable
from megatron_ckpt_ext.validation import check_fsdp
from tests._support import ROOT
from tests._support.mcore0192 import EXPERIMENTAL, FSDP_SRC, needs_0192
from tests._support.mcore0192 import subprocess_env as _env

SCRIPT = ROOT / "tools" / "check_fsdp_symm_mem.py"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, env=_env(**env))


# -- detection -----------------------------------------------------------------------------------
def test_installed_megatron_core_without_experimental_fsdp_is_detected_as_absent():
    caps = backend.detect()
    if caps.mcore_version and tuple(map(int, caps.mcore_version.split(".")[:2])) >= (0, 19):
        pytest.skip(f"installed megatron-core {caps.mcore_version} may have it")
    backend.megatron_fsdp._fsdp_probe.cache_clear()
    ok, reason = backend.fsdp_symm_mem_support()
    assert not ok
    assert "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental" in reason
    assert "megatron-core 0.19.2" in reason  # names the release that has it
    with pytest.raises(BackendUnavailable, match="experimental Megatron-FSDP"):
        backend.megatron_fsdp_api()


def test_installed_megatron_core_falls_back_with_one_warning(caps_factory, caplog):
    """On a CUDA machine with megatron-core 0.16.1 the flag is a warning (once), not an error."""
    caps = caps_factory(cuda_available=True)  # the real detection, as if CUDA were here
    if caps.fsdp_symm_mem:
        pytest.skip(f"installed megatron-core {caps.mcore_version} has use_symm_mem")
    from megatron_ckpt_ext.validation import check

    _runtime._reset_warnings_for_tests()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            check(CkptOptions(fsdp_use_symm_mem=True), caps)
            check_fsdp(CkptOptions(fsdp_use_symm_mem=True), caps, fsdp_ranks=2)
    warned = _symm_warnings(caplog)
    assert len(warned) == 1 and f"megatron-core {caps.mcore_version}" in warned[0]
    _runtime._reset_warnings_for_tests()


@needs_0192
def test_real_0192_fully_shard_is_detected_with_use_symm_mem():
    r = _python("from megatron_ckpt_ext import backend\n"
                "import json; ok, why = backend.fsdp_symm_mem_support()\n"
                "api = backend.megatron_fsdp_api()\n"
                "print(json.dumps([ok, why, api.module, api.fully_shard_optimizer is not None]))",
                PYTHONPATH=os.pathsep.join([str(FSDP_SRC), str(ROOT)]))
    assert r.returncode == 0, r.stderr[-2000:]
    ok, why, module, has_optimizer_hooks = json.loads(r.stdout.strip().splitlines()[-1])
    assert ok and "takes use_symm_mem" in why
    assert module == "megatron_fsdp.experimental" and has_optimizer_hooks


@needs_0192
def test_megatron_core_0192_copy_declares_use_symm_mem_down_to_the_buffers():
    """The path megatron-core itself imports (not importable here): its source declares the
    parameter on fully_shard, FsdpModule and FsdpParameterGroup, which allocates from the pool."""
    for file, func in (("fully_shard.py", "fully_shard"), ("module.py", "__init__"),
                       ("parameter_group.py", "__init__")):
        tree = ast.parse((EXPERIMENTAL / file).read_text())
        defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func]
        params = [[a.arg for a in d.args.args + d.args.kwonlyargs] for d in defs]
        assert any("use_symm_mem" in names for names in params), file
    assert "get_mem_pool" in (EXPERIMENTAL / "parameter_group.py").read_text()


def _fake_fsdp_package(monkeypatch: pytest.MonkeyPatch, name: str, fully_shard: Any) -> str:
    """Stand-in modules ``name`` and ``name.experimental`` (+ ``.module``) in sys.modules."""
    def module(dotted: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(dotted)
        m.__spec__ = importlib.machinery.ModuleSpec(dotted, None)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, dotted, m)
        return m

    module(name, MixedPrecisionPolicy=type("MixedPrecisionPolicy", (), {}))
    module(f"{name}.experimental", fully_shard=fully_shard, Flat=type("Flat", (), {}),
           Placements=type("Placements", (), {}))
    module(f"{name}.experimental.module", FsdpModule=type("FsdpModule", (), {}))
    return f"{name}.experimental"


def test_detection_needs_a_declared_use_symm_mem_parameter(monkeypatch):
    def catch_all(module, mesh, placements, **kwargs):  # a **kwargs catch-all does not count
        return None

    def declared(module, mesh, placements, mixed_precision_policy=None, use_symm_mem=False):
        return None

    old = _fake_fsdp_package(monkeypatch, "mcx_fake_old_fsdp", catch_all)
    new = _fake_fsdp_package(monkeypatch, "mcx_fake_new_fsdp", declared)
    api, _ = backend.megatron_fsdp._fsdp_probe((old,))
    assert api is not None and api.use_symm_mem is False
    api, _ = backend.megatron_fsdp._fsdp_probe(("mcx_not_installed.experimental", new))
    assert api is not None and api.module == new and api.use_symm_mem is True
    api, why = backend.megatron_fsdp._fsdp_probe(("mcx_not_installed.experimental",))
    assert api is None and "not installed" in why


# -- validation ----------------------------------------------------------------------------------
def test_flag_is_an_error_on_cpu_naming_the_flag(caps_factory):
    with pytest.raises(CkptOptionsError, match="--fsdp-use-symm-mem needs CUDA"):
        check_fsdp(CkptOptions(fsdp_use_symm_mem=True), caps_factory(cuda_available=False),
                   fsdp_ranks=2)


def test_flag_is_an_error_with_one_gpu_in_the_mesh(caps_factory):
    caps = caps_factory(cuda_available=True, fsdp_symm_mem=True)
    with pytest.raises(CkptOptionsError, match="--fsdp-use-symm-mem needs at least 2 GPUs") as e:
        check_fsdp(CkptOptions(fsdp_use_symm_mem=True), caps, fsdp_ranks=1)
    assert "--nproc-per-node 2" in str(e.value)
    assert check_fsdp(CkptOptions(fsdp_use_symm_mem=True), caps, fsdp_ranks=2) == []
    assert check_fsdp(CkptOptions(), caps_factory(cuda_available=False), fsdp_ranks=1) == []


def test_config_key_and_cli_flag_reach_the_option():
    assert CkptOptions.from_config({"fsdp_use_symm_mem": True}).fsdp_use_symm_mem is True
    assert CkptOptions.from_config({}).fsdp_use_symm_mem is False
    parser = add_arguments(argparse.ArgumentParser())
    assert CkptOptions.from_args(parser.parse_args(["--fsdp-use-symm-mem"])).fsdp_use_symm_mem
    assert not CkptOptions.from_args(parser.parse_args([])).fsdp_use_symm_mem


# -- wrap_fsdp against a mocked fully_shard ------------------------------------------------------
class _Mesh:
    ndim = 1

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _Flat:
    pass


@dataclasses.dataclass
class _Placements:
    dp_axes: list
    parameter: list
    gradient: list
    optimizer: list


@pytest.fixture
def fake_api(mocker, caps_factory):
    """Patch the backend: a mock fully_shard (taking use_symm_mem or not) and a CUDA machine."""
    _runtime._reset_warnings_for_tests()
    mocker.patch.object(backend, "detect", return_value=caps_factory(cuda_available=True))

    def make(*, use_symm_mem: bool, fully_shard: Any = None) -> backend.FsdpApi:
        api = backend.FsdpApi(
            module="fake.experimental", version="0.0", fully_shard=fully_shard or mocker.Mock(),
            fully_shard_optimizer=mocker.Mock(), flat=_Flat, placements=_Placements,
            mixed_precision_policy=None, fsdp_module=type("FsdpModule", (), {}),
            use_symm_mem=use_symm_mem)
        mocker.patch.object(backend, "megatron_fsdp_api", return_value=api)
        return api

    yield make
    _runtime._reset_warnings_for_tests()


def _symm_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "--fsdp-use-symm-mem" in r.getMessage() and r.levelno == logging.WARNING]


@pytest.mark.parametrize("supported, flag, passed", [
    (True, True, True), (True, False, False), (False, True, None), (False, False, None)])
def test_use_symm_mem_is_passed_exactly_when_fully_shard_takes_it(fake_api, caplog, supported,
                                                                  flag, passed):
    api = fake_api(use_symm_mem=supported)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            fsdp.wrap_fsdp(nn.Linear(2, 2), CkptOptions(fsdp_use_symm_mem=flag), mesh=_Mesh(2))
    kwargs = api.fully_shard.call_args.kwargs
    assert kwargs.get("use_symm_mem", None) is passed
    assert ("use_symm_mem" in kwargs) is supported
    assert isinstance(kwargs["placements"], _Placements) and kwargs["placements"].dp_axes == [0]
    warned = _symm_warnings(caplog)
    if flag and not supported:  # plain FSDP, said once for both calls
        assert len(warned) == 1 and "plain FSDP buffers" in warned[0]
    else:
        assert warned == []


def test_flag_on_cpu_is_refused_before_anything_is_sharded(fake_api, mocker, caps_factory):
    api = fake_api(use_symm_mem=True)
    mocker.patch.object(backend, "detect", return_value=caps_factory(cuda_available=False))
    with pytest.raises(CkptOptionsError, match="--fsdp-use-symm-mem"):
        fsdp.wrap_fsdp(nn.Linear(2, 2), CkptOptions(fsdp_use_symm_mem=True), mesh=_Mesh(2))
    api.fully_shard.assert_not_called()


def test_flag_with_a_one_rank_mesh_is_refused(fake_api):
    api = fake_api(use_symm_mem=True)
    with pytest.raises(CkptOptionsError, match="at least 2 GPUs"):
        fsdp.wrap_fsdp(nn.Linear(2, 2), CkptOptions(fsdp_use_symm_mem=True), mesh=_Mesh(1))
    api.fully_shard.assert_not_called()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.head = nn.Linear(2, 1)
        self.scale = nn.Parameter(torch.ones(1))  # owned by no unit: the root must be sharded


def _replacing_fully_shard(module: nn.Module, *, mesh: Any, **kwargs: Any) -> None:
    """Like Megatron-FSDP: installs new Parameter objects (unowned ones) under the same names."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and not getattr(p, "_fake_sharded", False):
                new = nn.Parameter(p.detach().float())
                new._fake_sharded = True
                sub._parameters[name] = new


def test_units_innermost_first_then_the_root_and_the_optimizer_follows(fake_api, mocker):
    calls: list[nn.Module] = []
    def record(module: nn.Module, **kwargs: Any) -> None:
        calls.append(module)
        _replacing_fully_shard(module, **kwargs)

    shard = mocker.Mock(side_effect=record)
    api = fake_api(use_symm_mem=True, fully_shard=shard)
    net = _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    fsdp.wrap_fsdp(net, CkptOptions(), mesh=_Mesh(2), units=[net.block, net.block[0], net.head],
                   optimizer=optimizer)
    assert calls == [net.block[0], net.block, net.head, net]  # deeper first, root last
    params = optimizer.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in net.parameters()]  # the sharded ones
    assert all(p._fake_sharded for p in params)
    api.fully_shard_optimizer.assert_called_once_with(optimizer, precision_aware=False)


def test_root_is_not_sharded_when_units_own_every_parameter(fake_api):
    api = fake_api(use_symm_mem=True)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fsdp.wrap_fsdp(net, CkptOptions(), mesh=_Mesh(2), units=list(net))
    assert [c.args[0] for c in api.fully_shard.call_args_list] == list(net)


def test_unit_outside_the_model_is_an_error(fake_api):
    fake_api(use_symm_mem=True)
    with pytest.raises(ValueError, match="units must be submodules"):
        fsdp.wrap_fsdp(nn.Linear(2, 2), CkptOptions(), mesh=_Mesh(2), units=[nn.Linear(2, 2)])


def test_optimizer_after_its_first_step_is_refused(fake_api):
    fake_api(use_symm_mem=False, fully_shard=_replacing_fully_shard)
    net = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="before the first optimizer step"):
        fsdp.wrap_fsdp(net, CkptOptions(), mesh=_Mesh(2), optimizer=optimizer)


def test_fsdp_module_imports_no_backend():
    r = _python("import sys, megatron_ckpt_ext.fsdp\n"
                "print(sorted(m for m in sys.modules\n"
                "             if m.startswith(('megatron.', 'megatron_fsdp'))))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


# -- the GPU script's refusals -------------------------------------------------------------------
@pytest.mark.parametrize("env, expected", [
    ({}, "launch with torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "needs 2 ranks"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}, "needs 2 CUDA GPUs"),
    ({"NCCL_NVLS_ENABLE": "1"}, "NVLink SHARP and multicast off"),
])
def test_script_refuses_clearly_without_two_gpus(tmp_path, env, expected):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env=_env(**env))
    assert r.returncode == 2, r.stderr[-2000:]
    assert expected in r.stderr
    assert not (tmp_path / "fsdp_symm_mem.json").exists()


# -- the other side of each symmetric collective, on the real Megatron-FSDP 0.19.2 objects ------
_REGISTER_CODE = r"""
import contextlib, json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from megatron_ckpt_ext import backend, fsdp
from megatron_fsdp.experimental import dbuffer

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
api = backend.megatron_fsdp_api()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
placements = fsdp.flat_placements(mesh, api=api)
for unit in (model[0], model[1]):
    api.fully_shard(unit, mesh=mesh, placements=placements, use_symm_mem=False)
groups = [g for _, g in fsdp._named_parameter_groups(model)]
before = {(i, a): getattr(g, a).local_buffer.clone() for i, g in enumerate(groups)
          for a in ("model_weight", "main_grad")}
ptrs = {k: getattr(groups[k[0]], k[1]).local_buffer.data_ptr() for k in before}
main_ptrs = [g.main_weight.local_buffer.data_ptr() for g in groups]
groups[0]._symm_mem_pool = "POOL0"       # as use_symm_mem=True leaves it (CPU: no real pool)
pools, rendezvous = [], []
@contextlib.contextmanager
def use_mem_pool(pool):
    pools.append(pool)
    yield
torch.cuda.use_mem_pool = use_mem_pool
dbuffer.DBuffer.rendezvous = lambda self, axis: rendezvous.append((self.local_buffer.data_ptr(), axis))
done = fsdp.register_sharded_buffers(model, api=api)
out = {"done": done, "pools": pools, "rendezvous_ptrs_ok": [
    p == getattr(groups[0], a).local_buffer.data_ptr() for (p, _), a in
    zip(rendezvous, ("model_weight", "main_grad"))], "axes": [a for _, a in rendezvous],
    "moved": {f"{i}.{a}": getattr(groups[i], a).local_buffer.data_ptr() != ptrs[(i, a)]
              for i, a in before},
    # bit patterns, not values: a DBuffer's padding is never written (NaN patterns compare unequal)
    "same_values": all(torch.equal(getattr(groups[i], a).local_buffer.view(torch.int16),
                                   v.view(torch.int16))
                       for (i, a), v in before.items() if a == "model_weight"),
    "main_weight_untouched": main_ptrs == [g.main_weight.local_buffer.data_ptr() for g in groups]}
groups[0].main_weight.local_buffer.add_(0.5)     # an optimizer step; then the hook's refresh
groups[0].sync_model_weight_from_main_weight()   # must land in the new buffer
out["refresh_reaches_new_buffer"] = torch.equal(
    groups[0].model_weight.local_buffer.view(torch.int16),
    groups[0].main_weight.local_buffer.to(torch.bfloat16).view(torch.int16))
print(json.dumps(out))
dist.destroy_process_group()
"""


@needs_0192
def test_sharded_buffers_move_into_the_pool_of_symm_mem_groups_only():
    """register_sharded_buffers (on real Megatron-FSDP 0.19.2 parameter groups): for a group that
    has a symmetric pool, the all-gather input (``model_weight``) and reduce-scatter output
    (``main_grad``) get new storage allocated under that pool, keep their values, are
    rendezvoused on their sharded axis, and later writes (the post-step refresh) reach the new
    storage; groups without a pool, and the optimizer's main weights, are left alone."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", _REGISTER_CODE, str(port)], capture_output=True,
                       text=True, timeout=180, cwd=ROOT,
                       env=_env(PYTHONPATH=os.pathsep.join([str(FSDP_SRC), str(ROOT)])))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["done"]["moved"] == ["0.model_weight", "0.main_grad"]
    assert out["done"]["kept"] == [] and out["done"]["bytes"] > 0
    assert out["pools"] == ["POOL0", "POOL0"]
    assert out["axes"] == [0, 0] and out["rendezvous_ptrs_ok"] == [True, True]
    assert out["moved"] == {"0.model_weight": True, "0.main_grad": True,
                            "1.model_weight": False, "1.main_grad": False}
    assert out["same_values"], out
    assert out["main_weight_untouched"], out
    assert out["refresh_reaches_new_buffer"], out


def test_wrap_fsdp_registers_the_sharded_buffers_only_with_the_flag(fake_api, mocker):
    api = fake_api(use_symm_mem=True)
    register = mocker.patch.object(fsdp, "register_sharded_buffers")
    net = nn.Sequential(nn.Linear(2, 2))
    fsdp.wrap_fsdp(net, CkptOptions(), mesh=_Mesh(2))
    register.assert_not_called()
    fsdp.wrap_fsdp(net, CkptOptions(fsdp_use_symm_mem=True), mesh=_Mesh(2))
    register.assert_called_once_with(net, api=api)
