"""The server's memory and the scheduler's slot pool (issue 29's fault soak: RSS grew 87.1 MiB after
the first minute): a slot goes back to the pool without its request's KV pages, with every output
equal to the request alone, and the engine thread hands the C heap's free pages back now and then."""

import asyncio
import threading
import time

import pytest
import torch

from test_batching import PROMPTS, gguf_engine, gguf_files, run_batched  # noqa: F401
from verispec.engine import SpeculativeConfig
from verispec.engine.scheduler import Scheduler
from verispec.runners.memory import PAGE_BYTES, release_pages, resident_bytes
from verispec.spec.sampling import SamplingParams

LINUX = resident_bytes(torch.empty(0)) is not None
needs_mincore = pytest.mark.skipif(not LINUX, reason="resident pages are counted with Linux's mincore")
LONG = [(5 * i + 1) % 90 + 3 for i in range(40)]  # a 40-token prompt


def kv_tensors(slot) -> list[torch.Tensor]:
    """The KV caches of a slot: its target's and its model drafters'."""
    runners = [slot.target] + [p.runner for p in slot.proposers.values() if hasattr(p, "runner")]
    return [t for r in runners for t in (r._keys, r._values)]


def pool_slots(scheduler: Scheduler) -> list:
    return scheduler._free_slots + [r.slot for r in scheduler.running]


@needs_mincore
def test_release_pages_hands_the_pages_back_and_they_read_zero():
    tensor = torch.empty(64 * PAGE_BYTES // 4)
    tensor.fill_(3.0)
    assert resident_bytes(tensor) >= 62 * PAGE_BYTES
    released = release_pages(tensor)
    assert released >= 62 * PAGE_BYTES
    assert resident_bytes(tensor) == 0
    inner = tensor[PAGE_BYTES // 4 : -PAGE_BYTES // 4]  # whole pages: the partial ends are left alone
    assert float(inner.abs().sum()) == 0.0


@needs_mincore
def test_slots_back_in_the_pool_hold_no_kv_pages(gguf_files):
    engine = gguf_engine(gguf_files)
    scheduler = Scheduler(engine, max_num_seqs=4)
    for i in range(4):
        scheduler.add(PROMPTS[i % len(PROMPTS)] + LONG, SamplingParams(max_tokens=12),
                      SpeculativeConfig(method="draft", num_speculative_tokens=3, schedule="constant"))
    while not all(r.state is not None and not r.state.prefilling for r in scheduler.running):
        scheduler.step()
    scheduler.step()  # and one draft + verify pass
    running = sum(resident_bytes(t) for r in scheduler.running for t in kv_tensors(r.slot))
    assert running >= 4 * 2 * PAGE_BYTES  # the measure sees the pages the requests wrote
    while scheduler.running or scheduler.waiting:
        scheduler.step()
    slots = pool_slots(scheduler)
    assert len(slots) == 4
    resident = [resident_bytes(t) for s in slots for t in kv_tensors(s)]
    assert len(resident) == 4 * 3 * 2 and resident == [0] * 24  # target, draft and tree drafter; K and V
    assert all(p.cached_token_ids == [] for s in slots for p in s.proposers.values() if hasattr(p, "cached_token_ids"))
    assert all(s.target.num_cached_tokens == 0 for s in slots)


def test_requests_on_released_slots_give_the_outputs_of_a_fresh_engine(gguf_files):
    engine = gguf_engine(gguf_files)
    requests = [(PROMPTS[i] + LONG[: 5 * i], SamplingParams(max_tokens=20, temperature=0.9, seed=7 + i),
                 SpeculativeConfig(method="draft", num_speculative_tokens=3, schedule="constant")) for i in range(6)]
    fresh = [gguf_engine(gguf_files).generate(*r).token_ids for r in requests]
    first, _ = run_batched(engine, requests, max_num_seqs=3)  # 6 requests over 3 slots: each slot reused
    again, _ = run_batched(engine, requests[::-1], max_num_seqs=3)
    assert first == fresh and again == fresh[::-1]


@pytest.mark.parametrize("every_s, expected", [(0.05, True), (1e9, False)])
def test_the_engine_thread_hands_free_heap_pages_back_every_interval(monkeypatch, every_s, expected):
    from server_support import tiny_pipeline
    from verispec.server import worker as worker_module
    from verispec.server.prom import ServerMetrics

    calls = []
    monkeypatch.setattr(worker_module, "release_freed_memory", lambda: calls.append(threading.current_thread().name))
    pipe = tiny_pipeline()
    worker = worker_module.EngineWorker(pipe.engine, max_queue=8, metrics=ServerMetrics(),
                                        warmup_prompt_token_ids=pipe.encode("Hello"),
                                        warmup_spec=SpeculativeConfig(method="none"), heap_trim_every_s=every_s)
    worker.start()
    try:
        assert worker.ready.wait(30)
        loop = asyncio.new_event_loop()
        job = worker_module.Job(pipe.encode("Hello"), SamplingParams(max_tokens=4), SpeculativeConfig(method="none"), loop)
        worker.submit(job)
        time.sleep(0.5)  # idle turns after it: 0.1 s each
    finally:
        worker.stop()
        loop.close()
    assert (len(calls) >= 2) == expected and worker.heap_trims == len(calls)
    assert set(calls) <= {"verispec-engine"}  # between passes, on the engine's own thread
