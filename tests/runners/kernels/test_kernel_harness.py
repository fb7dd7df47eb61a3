"""The torch-free kernel harness (tests/runners/kernels): every instruction-set path equals the
portable one bit for bit.

tests/runners/kernels/run_harness.sh builds harness.cpp with the kernel core (the kernels' own flags) and runs
it: natively (every path this CPU runs: AVX-512, AVX2, AVX-VNNI here; and on any AVX2 host the AVX-VNNI
code path again with its one instruction, vpdpbusd, emulated exactly), and cross-compiled for AArch64
under qemu-aarch64 (the NEON path), twice: on qemu's "max" CPU (dotprod and i8mm: pairs of rows through
smmla) and on a Neoverse N1 (dotprod only: sdot). Each run must exit 0 and name the paths it compared,
so that a path silently left out cannot pass; the portable path's results must be the same on both
architectures (the oracle digest, NaN payloads folded).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "run_harness.sh"
CROSS_TOOLS = ("aarch64-linux-gnu-g++", "qemu-aarch64")
# the kernels' ISA names for the x86 features /proc/cpuinfo lists (dispatch.cpp needs them all)
X86_ISAS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "avxvnni": ("avx2", "fma", "f16c", "avx_vnni"),
}


def run_harness(target: str, qemu_cpu: str = "max") -> tuple[str, list[str], str]:
    """(output, the ISAs it compared, the oracle digest); fails the test on a non-zero exit."""
    result = subprocess.run(
        [str(SCRIPT), target], capture_output=True, text=True, timeout=900, env=dict(os.environ, QEMU_CPU=qemu_cpu)
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    summary = re.search(r"^SUMMARY: .*ISAs compared: (.*); oracle digest ([0-9a-f]+)$", result.stdout, re.M)
    assert summary, output[-3000:]
    assert "MISMATCH" not in result.stdout and "FAIL" not in result.stdout
    return output, summary.group(1).split(", "), summary.group(2)


@pytest.fixture(scope="module")
def native():
    if shutil.which("g++") is None:
        pytest.skip("no g++ (Debian: apt-get install g++)")
    return run_harness("native")


@pytest.fixture(scope="module")
def native_vnni():
    if shutil.which("g++") is None:
        pytest.skip("no g++ (Debian: apt-get install g++)")
    if not all(flag in cpu_flags() for flag in X86_ISAS["avx2"]):
        pytest.skip("the emulated AVX-VNNI build runs AVX2 instructions; this CPU has no AVX2")
    return run_harness("native-vnni")


def cross_tools():
    missing = [tool for tool in CROSS_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)")


@pytest.fixture(scope="module")
def aarch64():
    cross_tools()
    return run_harness("qemu", "max")


@pytest.fixture(scope="module")
def aarch64_without_i8mm():
    cross_tools()
    return run_harness("qemu", "neoverse-n1")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(found.group(1).split()) if found else set()


def test_every_native_path_equals_the_portable_one_bit_for_bit(native):
    output, compared, _ = native
    assert "portable" in compared
    flags = cpu_flags()
    for isa, needed in X86_ISAS.items():  # every vector path this CPU can run was compared
        if all(flag in flags for flag in needed):
            assert isa in compared, (isa, output[:500])
    assert re.search(r"^portable +tile Q4_K ", output, re.M)


def test_the_avx_vnni_code_path_equals_the_portable_one_with_vpdpbusd_emulated(native_vnni, native):
    output, compared, digest = native_vnni
    assert "avxvnni" in compared, output[:500]
    assert re.search(r"^verispec kernel harness on x86-64 \(cpu features: .*avxvnni\(emulated\)", output, re.M), output[
        :500
    ]
    assert digest == native[2]  # the same portable oracle in both builds
    assert re.search(r"^avxvnni +tile Q6_K random out=96 in=1024 k=1,3,8,11,16 .* OK$", output, re.M)
    assert re.search(r"^avxvnni +tile Q8_0 .* OK$", output, re.M)


@pytest.mark.parametrize("run, i8mm", [("aarch64", True), ("aarch64_without_i8mm", False)])
def test_the_neon_path_equals_the_portable_one_bit_for_bit_under_qemu(run, i8mm, request):
    output, compared, _ = request.getfixturevalue(run)
    assert "neon" in compared, output[:500]
    features = re.search(r"^verispec kernel harness on aarch64 \(cpu features: (.*)\)$", output, re.M)
    assert features and ("i8mm" in features.group(1).split()) == i8mm, output[:500]
    assert re.search(r"^neon +tile Q6_K .* OK$", output, re.M)
    assert re.search(r"^neon +attention tree .* OK$", output, re.M)


def test_the_portable_path_gives_the_same_results_on_x86_64_and_aarch64(native, aarch64):
    assert native[2] == aarch64[2]
