"""The server's memory and the scheduler's slot pool (issue 29's fault soak: RSS grew 87.1 MiB after
the first minute; n = 16 requests prefilled their prompt 16 times): a slot goes back to the pool
without its request's KV pages, the ``n`` choices of one prompt prefill it once (the others copy
the cache) with every output equal to the request alone, and the engine thread hands the C heap's
free pages back now and then."""

import asyncio
import threading
import time

import pytest
import torch

from batching_support import PROMPTS, gguf_engine, run_batched
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.scheduler import Scheduler
from verispec.runners.cpu.memory import PAGE_BYTES, release_pages, resident_bytes

LINUX = resident_bytes(torch.empty(0)) is not None
needs_mincore = pytest.mark.skipif(not LINUX, reason="resident pages are counted with Linux's mincore")
LONG = [(5 * i + 1) % 90 + 3 for i in range(40)]  # a 40-token prompt


def kv_tensors(slot) -> list[torch.Tensor]:
    """The KV caches of a slot: its target's and its model drafters'."""
    runners = [slot.target] + [p.runner for p in slot.proposers.values() if p.runner is not None]
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
        scheduler.add(
            PROMPTS[i % len(PROMPTS)] + LONG,
            SamplingParams(max_tokens=12),
            SpeculativeConfig(method="draft", num_speculative_tokens=3, schedule="constant"),
        )
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
    requests = [
        (
            PROMPTS[i] + LONG[: 5 * i],
            SamplingParams(max_tokens=20, temperature=0.9, seed=7 + i),
            SpeculativeConfig(method="draft", num_speculative_tokens=3, schedule="constant"),
        )
        for i in range(6)
    ]
    fresh = [gguf_engine(gguf_files).generate(*r).token_ids for r in requests]
    first, _ = run_batched(engine, requests, max_num_seqs=3)  # 6 requests over 3 slots: each slot reused
    again, _ = run_batched(engine, requests[::-1], max_num_seqs=3)
    assert first == fresh and again == fresh[::-1]


def rows_and_outputs(engine, requests, max_num_seqs=8, cancel=None):
    """Run ``requests`` through one scheduler; the target rows of all passes and each output."""
    scheduler = Scheduler(engine, max_num_seqs=max_num_seqs)
    handles = [scheduler.add(*r, tag=i) for i, r in enumerate(requests)]
    outputs, rows, steps = [None] * len(requests), 0, 0
    while scheduler.running or scheduler.waiting:
        for handle, chunk in scheduler.step():
            if chunk.output is not None:
                outputs[handle.tag] = chunk.output
        rows += engine.last_pass_rows
        steps += 1
        if cancel is not None and steps == cancel[1]:
            scheduler.cancel(handles[cancel[0]])
    return rows, outputs


@pytest.mark.parametrize("method", ["none", "draft"])
def test_n_choices_of_one_prompt_prefill_it_once_with_outputs_as_alone(gguf_files, method):
    engine = gguf_engine(gguf_files)
    prompt = PROMPTS[2] + LONG  # 50 tokens
    spec = SpeculativeConfig(method=method, num_speculative_tokens=2, schedule="constant")
    requests = [(prompt, SamplingParams(max_tokens=4), spec)] + [
        (prompt, SamplingParams(max_tokens=4, temperature=0.8, seed=100 + i), spec) for i in range(7)
    ]
    alone = [gguf_engine(gguf_files).generate(*r) for r in requests]
    rows, outputs = rows_and_outputs(engine, requests)
    assert [o.token_ids for o in outputs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outputs}) > 2  # the seeds really differ
    decode_rows = 8 * 3 * (1 + 2)  # at most: 3 verify passes of the pending token and 2 drafts each
    assert rows <= len(prompt) + 7 + decode_rows  # one prefill and one row per other choice
    assert rows < 2 * len(prompt)  # each choice prefilling its own would be >= 8 * 50 rows


def test_choices_left_waiting_by_a_cancelled_source_prefill_their_own(gguf_files):
    engine = gguf_engine(gguf_files, max_num_batched_tokens=8)  # the source's prefill takes passes
    prompt = PROMPTS[0] + LONG
    requests = [(PROMPTS[1], SamplingParams(max_tokens=30), SpeculativeConfig(method="none"))] + [
        (prompt, SamplingParams(max_tokens=5, temperature=0.7, seed=i), SpeculativeConfig(method="none"))
        for i in range(4)
    ]
    alone = [gguf_engine(gguf_files).generate(*r).token_ids for r in requests]
    _, outputs = rows_and_outputs(engine, requests, cancel=(1, 2))  # the source goes mid-prefill
    assert outputs[1] is None
    assert [o.token_ids for i, o in enumerate(outputs) if i != 1] == [a for i, a in enumerate(alone) if i != 1]


def test_prompt_logprobs_requests_prefill_their_own_prompt(gguf_files):
    engine = gguf_engine(gguf_files)
    prompt = PROMPTS[2] + LONG
    requests = [(prompt, SamplingParams(max_tokens=3, prompt_logprobs=1), SpeculativeConfig(method="none"))] * 3
    alone = gguf_engine(gguf_files).generate(*requests[0])
    rows, outputs = rows_and_outputs(engine, requests)
    assert rows >= 3 * len(prompt)
    assert all(o.prompt_logprobs == alone.prompt_logprobs and o.token_ids == alone.token_ids for o in outputs)


@pytest.mark.parametrize("every_s, expected", [(0.05, True), (1e9, False)])
def test_the_engine_thread_hands_free_heap_pages_back_every_interval(monkeypatch, every_s, expected):
    from server_support import tiny_pipeline
    from verispec.server import worker as worker_module
    from verispec.server.prom import ServerMetrics

    threads = []  # every engine thread alive calls the patched function (the session's test servers too)
    monkeypatch.setattr(worker_module, "release_freed_memory", lambda: threads.append(threading.current_thread()))
    pipe = tiny_pipeline()
    worker = worker_module.EngineWorker(
        pipe.engine,
        max_queue=8,
        metrics=ServerMetrics(),
        warmup_prompt_token_ids=pipe.encode("Hello"),
        warmup_spec=SpeculativeConfig(method="none"),
        heap_trim_every_s=every_s,
    )
    worker.start()
    try:
        assert worker.ready.wait(30)
        loop = asyncio.new_event_loop()
        job = worker_module.Job(
            pipe.encode("Hello"), SamplingParams(max_tokens=4), SpeculativeConfig(method="none"), loop
        )
        worker.submit(job)
        time.sleep(0.5)  # idle turns after it: 0.1 s each
    finally:
        worker.stop()
        loop.close()
    calls = [t for t in threads if t is worker._thread]  # between passes, on this worker's own thread
    assert (len(calls) >= 2) == expected and worker.heap_trims == len(calls)
