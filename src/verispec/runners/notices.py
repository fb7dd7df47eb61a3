"""What a user is told about how the models run on this CPU: the load line's name of a runner and
its kernels, and the plain warnings where a runner is slow here (the gguf kernels' portable path,
int8 without AVX-512 VNNI), each said once per process. Knows nothing about which runner was
chosen (:mod:`verispec.runners.choice` decides, and holds the kernels' facts), models or decoding.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

# measured on an AVX2-only AMD Zen 3 host (issue 26), the default pair: the portable path decoded at
# 1.10 tokens/s plain and 0.68 speculative (a k-token pass costs about k one-token steps there),
# llama.cpp at 10.06 plain
PORTABLE_COST = (
    "about 9x slower than llama.cpp (plain decoding 1.1 against 10.1 tokens/s on an AVX2-only host), "
    "and speculation slows it further"
)
INT8_KERNELS = {"onednn": "oneDNN VNNI int8 kernel", "int_mm": "torch._int_mm int8 kernel"}
_SAID: set[str] = set()


def say_once(key: str, text: str) -> None:
    """Print ``verispec: <text>`` on stderr the first time ``key`` is said in this process."""
    if key not in _SAID:
        _SAID.add(key)
        print(f"verispec: {text}", file=sys.stderr, flush=True)


def runner_label(kind: str, facts: Mapping[str, str]) -> str:
    """How the load line names a runner: ``gguf runner, avx512 kernels``, ``int8 runner, oneDNN
    VNNI int8 kernel``, ``llamacpp runner``; ``facts``: the kernels it runs
    (:func:`verispec.runners.choice.kernel_facts`)."""
    if "kernel_isa" in facts:
        return f"gguf runner, {facts['kernel_isa']} kernels"
    if "int8_kernel" in facts:
        slow = "" if facts["int8_kernel"] == "onednn" else " (slow here: no AVX-512 VNNI)"
        return f"int8 runner, {INT8_KERNELS[facts['int8_kernel']]}{slow}"
    return f"{kind} runner"


def portable_gguf_warning(*, llama_cpp_installed: bool, auto_uses_llama_cpp: bool = False) -> str | None:
    """What to say when the gguf kernels run on their portable path here (None: they do not):
    why it is slow and the faster option (``auto_uses_llama_cpp``: that ``auto`` took it)."""
    from verispec.runners.kernels import gguf_kernels, kernel_isa

    if kernel_isa() != "portable":
        return None
    kernels = gguf_kernels()
    best = kernels.best_isa()
    if best == "portable":
        features = kernels.cpu_features() or "none of AVX2, AVX-512, NEON"
        where = f"this CPU (features: {features}) runs the gguf kernels on their portable path"
    else:
        where = (
            "the gguf kernels run on their portable path (forced by VERISPEC_KERNEL_ISA or set_kernel_isa; "
            f"this CPU could run {best})"
        )
    if auto_uses_llama_cpp:
        advice = (
            "--runner auto uses llama.cpp instead (not token-identical under speculation; "
            "--runner gguf keeps exactness at this speed)"
        )
    elif best != "portable":
        advice = "use --runner llamacpp"
    elif llama_cpp_installed:
        advice = "use --runner llamacpp (faster here, not token-identical under speculation)"
    else:
        advice = "use --runner llamacpp (pip install 'verispec[llamacpp]') or a CPU with AVX2 or NEON"
    if best != "portable":
        advice += f"; unset VERISPEC_KERNEL_ISA for the {best} path"
    return f"{where}, {PORTABLE_COST}; {advice}"


def inexact_warning(kind: str, dtype: str = "float32") -> str | None:
    """Why greedy speculative output on the ``kind`` runner (weights in ``dtype``) can differ from
    plain decoding at near-ties, naming the exact option; None where it cannot (gguf and int8 are
    batch-invariant, torch in float32 on a CPU rounds a k-token pass as it rounds k steps)."""
    if kind == "llamacpp":
        return (
            "llama.cpp computes a k-token batch differently from a 1-token step, so greedy speculative output "
            "can differ from plain llama.cpp decoding at near-ties; use --runner gguf for token-identical output"
        )
    if kind == "torch" and dtype != "float32":
        return (
            f"{dtype} matmuls on this CPU round a k-token verify pass slightly differently from a 1-token decode "
            "step, so at near-ties greedy speculative output can differ from plain decoding; use --dtype float32 "
            "for token-identical output"
        )
    return None


INT8_SLOW = (
    "oneDNN's int8 product is missing or not exact on this CPU (exact needs AVX-512 VNNI), so the int8 runner "
    "multiplies with torch._int_mm: several times slower (below 0.35 tokens/s for the 1.5B target on "
    "an AVX2-only host)"
)


def int8_warning(*, auto: bool) -> str | None:
    """What to say when the int8 runner would run ``torch._int_mm`` here (None: it runs oneDNN);
    ``auto``: that ``--runner auto`` leaves it out."""
    from verispec.runners.cpu.int8_ops import default_kernel

    if default_kernel() == "onednn":
        return None
    if auto:
        return f"--runner auto leaves out the int8 runner: {INT8_SLOW}; --runner int8 still runs it, exact and slow"
    return f"{INT8_SLOW}; --runner gguf is the fast exact runner for GGUF files on a CPU with AVX2 or NEON"
