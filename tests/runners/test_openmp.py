"""Releasing the loading thread's OpenMP pool before another thread drives the model."""

import threading

import torch

from verispec.runners.openmp import release_thread_pool


def test_release_then_compute_on_another_thread_gives_the_same_numbers():
    a = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    b = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    before = a @ b  # this thread opens a parallel region (its pool exists)
    assert release_thread_pool() is True  # torch's libgomp has omp_pause_resource_all
    results = []
    worker = threading.Thread(target=lambda: results.append(a @ b))
    worker.start()
    worker.join()
    assert torch.equal(results[0], before)
    assert torch.equal(a @ b, before)  # and this thread can still compute (a new pool)
