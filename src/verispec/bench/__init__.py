"""Benchmarks: workloads, the interleaved runner over verispec methods and peers, figures, reports.

``workload`` reads prompts, ``run`` times every runner on them prompt by prompt, ``figures``
turns per-prompt records into the summary (pure arithmetic), ``report`` writes and reads
``results.json`` / ``report.md`` and ``plots`` draws the PNGs. Knows nothing about how decoding
works: it calls the engine and the peers and reads their metrics.
"""
