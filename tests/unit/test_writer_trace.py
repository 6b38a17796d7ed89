"""MCX_WRITER_TRACE: the request's preload and write, and the write's results hand-back, are
traced from whichever process runs them; the request's own functions still run."""

import json
import queue
from typing import Any, Callable, NamedTuple, Optional

from megatron_ckpt_ext.debug import trace_event, traced_request


class _Request(NamedTuple):
    async_fn: Optional[Callable]
    async_fn_args: tuple
    preload_fn: Optional[Callable] = None


def test_preload_write_and_results_put_are_traced(tmp_path):
    results: queue.Queue = queue.Queue()

    def write(rank: int, buckets: Any, results_queue: Any) -> None:
        results_queue.put({"rank": rank, "buckets": buckets})

    request = traced_request(_Request(write, (0, ["b"], results), lambda: ["b"]), str(tmp_path),
                             rank=3)
    assert request.preload_fn() == ["b"]
    request.async_fn(*request.async_fn_args)
    assert results.get_nowait() == {"rank": 0, "buckets": ["b"]}  # the real queue got it
    lines = [json.loads(ln) for ln in (tmp_path / "writer_trace.jsonl").read_text().splitlines()]
    assert [ln["what"] for ln in lines] == ["preload", "results_put", "write"]
    assert all(ln["s"] >= 0 and ln["end"] >= ln["start"] for ln in lines)
    assert {ln["rank"] for ln in lines} == {3}  # the trainer's rank, whichever process writes
    for ln in lines[::2]:  # preload and write also carry the calling thread's usage
        assert ln["cpu_s"] >= 0 and ln["minflt"] >= 0 and ln["nvcsw"] >= 0, ln


def test_a_request_without_functions_is_left_alone(tmp_path):
    request = _Request(None, ())
    assert traced_request(request, str(tmp_path), rank=0) == request
    assert not (tmp_path / "writer_trace.jsonl").exists()


def test_an_event_is_written_only_when_the_trace_is_on(tmp_path):
    trace_event("", "committed", rank=0, iteration=1)  # MCX_WRITER_TRACE unset: nothing anywhere
    trace_event(str(tmp_path / "t"), "committed", rank=1, iteration=7)
    (line,) = (tmp_path / "t" / "writer_trace.jsonl").read_text().splitlines()
    assert json.loads(line) | {"pid": 0, "end": 0} == {"what": "committed", "pid": 0, "rank": 1,
                                                        "end": 0, "iteration": 7}
