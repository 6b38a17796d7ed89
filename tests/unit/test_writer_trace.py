"""MCX_WRITER_TRACE: the request's preload and write, and the write's results hand-back, are
traced from whichever process runs them; the request's own functions still run."""

import json
import queue
from typing import Any, Callable, NamedTuple, Optional

from megatron_ckpt_ext.checkpointer import _traced_request


class _Request(NamedTuple):
    async_fn: Optional[Callable]
    async_fn_args: tuple
    preload_fn: Optional[Callable] = None


def test_preload_write_and_results_put_are_traced(tmp_path):
    results: queue.Queue = queue.Queue()

    def write(rank: int, buckets: Any, results_queue: Any) -> None:
        results_queue.put({"rank": rank, "buckets": buckets})

    request = _traced_request(_Request(write, (0, ["b"], results), lambda: ["b"]), str(tmp_path))
    assert request.preload_fn() == ["b"]
    request.async_fn(*request.async_fn_args)
    assert results.get_nowait() == {"rank": 0, "buckets": ["b"]}  # the real queue got it
    lines = [json.loads(ln) for ln in (tmp_path / "writer_trace.jsonl").read_text().splitlines()]
    assert [ln["what"] for ln in lines] == ["preload", "results_put", "write"]
    assert all(ln["s"] >= 0 and ln["end"] >= ln["start"] for ln in lines)
    for ln in lines[::2]:  # preload and write also carry the calling thread's usage
        assert ln["cpu_s"] >= 0 and ln["minflt"] >= 0 and ln["nvcsw"] >= 0, ln


def test_a_request_without_functions_is_left_alone(tmp_path):
    request = _Request(None, ())
    assert _traced_request(request, str(tmp_path)) == request
    assert not (tmp_path / "writer_trace.jsonl").exists()
