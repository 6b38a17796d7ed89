"""save/handover.py: under a constant structure, a persistent writer's request pickles its long
lists (write items, staged tensors) once per key; the writer reuses what it built, live on the
staged shared memory; a freed segment ends every key on both sides; anything else pickles as
it is."""

from __future__ import annotations

import pickle
from collections import namedtuple
from functools import partial
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_ckpt_ext.options import CkptOptions
from megatron_ckpt_ext.save import handover
from megatron_ckpt_ext.save.handover import Kept, kept_in_writer
from megatron_ckpt_ext.staging.shm import ShmStager

pytestmark = pytest.mark.unit

N = handover.MIN_LENGTH + 4


@pytest.fixture
def stager(tmp_path):
    s = ShmStager(job_id="handover", rank=0, reuse=True, pin=False, shm_dir=str(tmp_path),
                  sweep=False)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _fresh_caches():
    handover._SENT.clear(), handover._KEPT.clear()
    yield
    handover._SENT.clear(), handover._KEPT.clear()


def _staged(stager) -> list[torch.Tensor]:
    sources = [torch.full((3, i + 1), 1.0 + i) for i in range(N)]
    return stager.stage(sources, keys=[f"t{i}" for i in range(N)]).tensors


def _views(staged: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t[:] for t in staged]  # new tensor objects on the same buffers, as at every save


def _round_trip(items: list) -> list:
    return pickle.loads(ForkingPickler.dumps(Kept(items)))


def _delta(before: dict) -> dict:
    return {k: handover.stats[k] - before[k] for k in ("sent_whole", "sent_known", "built",
                                                       "reused")}


def test_staged_tensors_go_in_full_once_then_by_key_and_the_writer_reuses_its_mapping(stager):
    staged = _staged(stager)
    before = dict(handover.stats)
    first = _round_trip(_views(staged))
    assert _delta(before) == {"sent_whole": 1, "sent_known": 0, "built": 1, "reused": 0}
    assert all(torch.equal(a, b) for a, b in zip(first, staged))

    for t in staged:
        t.fill_(7.0)  # the next save's copies into the same buffers
    before = dict(handover.stats)
    second = _round_trip(_views(staged))  # the next save: new views of the same buffers
    assert _delta(before) == {"sent_whole": 0, "sent_known": 1, "built": 0, "reused": 1}
    # what the writer kept maps the staged memory itself: it reads this save's bytes
    assert all(torch.equal(a, b) for a, b in zip(second, staged))
    assert second[0][0, 0].item() == 7.0
    assert second is not first and second[0] is first[0]  # a list of its own, the same mapping


def test_write_items_and_pairs_are_kept_by_identity(stager):
    items = [WriteItem(index=MetadataIndex(f"w{i}"), type=WriteItemType.BYTE_IO)
             for i in range(N)]
    staged = _staged(stager)
    for payload in (items, list(zip(items, _views(staged)))):
        handover._KEPT.clear()
        before = dict(handover.stats)
        first, second = _round_trip(list(payload)), _round_trip(list(payload))
        assert first[0] is not payload[0] and second[-1] is first[-1]  # built once, reused
        assert repr(first) == repr(payload)
        assert _delta(before) == {"sent_whole": 1, "sent_known": 1, "built": 1, "reused": 1}
    # equal items that are other objects are another key
    before = dict(handover.stats)
    _round_trip([WriteItem(index=i.index, type=i.type) for i in items])
    assert _delta(before)["sent_whole"] == 1


def test_a_freed_segment_ends_every_key_on_both_sides(stager, tmp_path):
    staged = _staged(stager)
    _round_trip(_views(staged))
    other = ShmStager(job_id="other", rank=0, reuse=True, pin=False, shm_dir=str(tmp_path),
                      sweep=False)
    other.stage([torch.ones(4)], keys=["x"])
    other.close()  # frees a segment of this process: data pointers may be handed out again
    before = dict(handover.stats)
    again = _round_trip(_views(staged))
    assert _delta(before) == {"sent_whole": 1, "sent_known": 0, "built": 1, "reused": 0}
    assert all(torch.equal(a, b) for a, b in zip(again, staged))
    assert len(handover._KEPT) == 1  # the writer let go of the older epoch's mappings


def test_lists_not_on_kept_segments_pickle_as_they_are(tmp_path):
    plain = [torch.full((2,), float(i)) for i in range(N)]
    before = dict(handover.stats)
    got = _round_trip(plain)
    assert _delta(before) == {"sent_whole": 0, "sent_known": 0, "built": 0, "reused": 0}
    assert type(got) is list and all(torch.equal(a, b) for a, b in zip(got, plain))
    with ShmStager(job_id="noreuse", rank=0, reuse=False, pin=False, shm_dir=str(tmp_path),
                   sweep=False) as fresh:  # buffers not kept across saves: never keyed
        staged = fresh.stage([torch.ones(3) for _ in range(N)], keys=[str(i) for i in range(N)])
        _round_trip(list(staged.tensors))
    assert _delta(before)["sent_whole"] == 0
    kept = Kept(plain)  # a write run in this process sees the list itself
    assert isinstance(kept, list) and kept == plain


Request = namedtuple("Request", "async_fn async_fn_args preload_fn")
Pair = namedtuple("Pair", "first second")


def _ctx(**options):
    return SimpleNamespace(is_async=True, persistent=True,
                           options=CkptOptions(ckpt_assume_constant_structure=True, **options))


def test_the_step_wraps_long_lists_where_the_providers_put_them_and_nothing_else(stager,
                                                                                 monkeypatch):
    staged = _views(_staged(stager))
    items = [WriteItem(index=MetadataIndex(f"w{i}"), type=WriteItemType.SHARD) for i in range(N)]
    short = staged[:3]
    # nvrx 0.7: preload partial -> (dir, (id, (hint, cached, (items, tensors), ...)))
    preload = partial(len, ("dir", (None, ("hint", None, (items, staged), short))))
    # megatron-core 0.16: write buckets [(path, key, (bytes, [(item, tensor), ...]))]
    buckets = [("f", "k", ([], list(zip(items, staged))))]
    request = Request(print, (0, buckets, Pair(short, 1)), preload)
    out = kept_in_writer(request, _ctx())
    inner = out.preload_fn.args[0][1][1][2]
    assert isinstance(inner[0], Kept) and isinstance(inner[1], Kept) and inner[0] == items
    assert out.preload_fn.args[0][1][1][3] is short and out.preload_fn.func is len
    assert isinstance(out.async_fn_args[1][0][2][1], Kept)
    assert out.async_fn_args[2] is request.async_fn_args[2]  # unchanged parts stay as they were
    assert out.async_fn is print

    assert kept_in_writer(request, SimpleNamespace(**{**vars(_ctx()), "persistent": False})) \
        is request
    assert kept_in_writer(request, SimpleNamespace(
        is_async=True, persistent=True, options=CkptOptions())) is request
    monkeypatch.setenv("MCX_RESEND_EACH_SAVE", "1")
    assert kept_in_writer(request, _ctx()) is request


def test_the_sender_holds_the_write_items_never_the_staged_memory(stager):
    staged = _views(_staged(stager))
    items = [WriteItem(index=MetadataIndex(f"w{i}"), type=WriteItemType.SHARD) for i in range(N)]
    for payload in (staged, list(zip(items, staged))):
        ForkingPickler.dumps(Kept(payload))
    held = [x for entry in handover._SENT.values() for x in entry[2]]
    assert held and all(isinstance(x, WriteItem) for x in held)
