"""``verispec bench-runners`` on a terminal: its report (:func:`verispec.ops.bench.runner_compare.run_runners_bench`)
as rich tables."""

from __future__ import annotations


def format_table(report: dict):
    """Two rich tables: cost curves (ms and ratio to k=1) and methods (tokens/s, speedup vs the peer);
    the first title names the kernels that ran (``report["machine"]``: gguf's ISA path, int8's product)."""
    from rich.table import Table

    machine = report.get("machine", {})
    kernels = [f"gguf kernels {machine['kernel_isa']}"] if machine.get("kernel_isa") else []
    kernels += [f"int8 kernel {machine['int8_kernel']}"] if machine.get("int8_kernel") else []
    curves = Table(title="cost of one forward of k new tokens after a 64-token context (median ms)" + "".join(f" · {k}" for k in kernels))
    ks = [1, 2, 4, 8, 16]
    for column in ["runner", "model"] + [f"k={k}" for k in ks] + ["8/1"]:
        curves.add_column(column, justify="right" if column.startswith("k") or column == "8/1" else "left")
    for kind, roles in report["curves"].items():
        for role, data in roles.items():
            if not isinstance(data, dict) or "ms" not in data:
                continue
            ms = {int(k): v for k, v in data["ms"].items()}
            curves.add_row(kind, role, *[f"{ms[k]:.1f}" for k in ks], f"{ms[8] / ms[1]:.2f}")
    methods = Table(title="end to end, greedy, same prompts (tokens/s include prefill)")
    for column in ("runner", "method", "tokens/s", "vs peer", "tokens", "accept", "mean len", "draft ms/tok"):
        methods.add_column(column, justify="left" if column in ("runner", "method") else "right")
    peer = next((m["tokens_per_s"] for m in report["methods"] if m["runner"] == "llama-cpp-python"), None)
    for m in report["methods"]:
        ratio = f"{m['tokens_per_s'] / peer:.2f}x" if peer else "—"
        fmt = lambda v, p="{:.2f}": "—" if v is None else p.format(v)  # noqa: E731
        methods.add_row(m["runner"], m["method"], f"{m['tokens_per_s']:.2f}", ratio, str(m["tokens"]),
                        fmt(m.get("acceptance_rate"), "{:.3f}"), fmt(m.get("mean_acceptance_length")), fmt(m.get("draft_ms_per_token"), "{:.1f}"))
    tables = [curves, methods]
    if report.get("quality"):
        quality = Table(title="against float32 (teacher-forced on its greedy output)")
        for column in ("runner", "top-1 agreement", "mean KL (nats)", "positions"):
            quality.add_column(column, justify="left" if column == "runner" else "right")
        for name, row in report["quality"].items():
            quality.add_row(name, f"{row['top1_agreement']:.4f}", f"{row['mean_kl_nats']:.5f}", str(row["positions"]))
        tables.append(quality)
    if report.get("exactness"):
        exact = Table(title="speculative output identical to the same runner's plain output (prompts)")
        for column in ("runner:method:tokens", "identical"):
            exact.add_column(column)
        for key, value in report["exactness"].items():
            exact.add_row(key, value)
        tables.append(exact)
    if report.get("prefill"):
        prefill = Table(title="prefill: one forward of the whole prompt (tokens/s)")
        lengths = sorted({int(n) for runs in report["prefill"].values() for n in runs})
        for column in ["runner"] + [f"{n} tokens" for n in lengths]:
            prefill.add_column(column, justify="left" if column == "runner" else "right")
        for kind, runs in report["prefill"].items():
            runs = {int(n): v for n, v in runs.items()}
            prefill.add_row(kind, *[f"{runs[n]['tokens_per_s']:.1f}" if n in runs else "—" for n in lengths])
        tables.append(prefill)
    return tables
