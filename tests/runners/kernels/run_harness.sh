#!/usr/bin/env bash
# Builds the torch-free kernel harness (tests/runners/kernels/harness.cpp with the kernel core) and runs it.
#
#   tests/runners/kernels/run_harness.sh native [--isas portable,avx512,...]   g++ for this machine
#   tests/runners/kernels/run_harness.sh native-vnni [--isas ...]   the same with AVX-VNNI's vpdpbusd emulated
#       exactly by AVX2 instructions (-DVSK_EMULATE_AVXVNNI), so an AVX2 host tests that path's code
#   tests/runners/kernels/run_harness.sh qemu   [--isas portable,neon]         AArch64 (ARMv8.2 + dotprod
#       + i8mm), static, run under qemu-aarch64 -cpu $QEMU_CPU (default max: dotprod and i8mm, the
#       smmla kernels; neoverse-n1: dotprod only, the sdot kernels)
#       (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)
#
# The flags are the kernels' own (-O3 -std=c++17 -ffp-contract=off -fno-math-errno, never
# -ffast-math). Before running, the objects are checked to hold no fused multiply-add (a fused
# operation rounds once, the portable arithmetic twice); for AArch64, arm_neon.cpp and
# arm_neon_float.cpp are also compiled with the kernels' flags alone (no -march, as the Python
# extension builds them) and the sdot kernels checked to hold no i8mm instruction (they run on CPUs
# without it). Objects live in $VSK_HARNESS_BUILD/<target>
# (default ${TMPDIR:-/tmp}/verispec-kernel-harness-<uid>-<checkout>/<target>) and are rebuilt when a
# source, core.h or this script is newer. Exit status: the harness's (0: every path bit-identical,
# 1: a mismatch, 2: usage); 3: cross tools missing, 4: a compile error, 5: fused multiply-adds.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
kernels="$(cd "$here/../../../src/verispec/runners/kernels" && pwd)"
target="${1:-}"
shift || true

CORE_SOURCES=(formats.cpp portable.cpp dispatch.cpp attention.cpp row_ops.cpp requantize.cpp x86_avx512.cpp x86_avx2.cpp arm_neon.cpp
              arm_neon_float.cpp)
FLAGS=(-O3 -std=c++17 -ffp-contract=off -fno-math-errno)

case "$target" in
    native | native-vnni)
        [[ "$target" == native-vnni ]] && FLAGS+=(-DVSK_EMULATE_AVXVNNI)
        cxx="${CXX:-g++}"
        objdump=objdump
        arch_flags=()
        link_flags=()
        run=()
        fused='\bv?f(n)?m(add|sub)[0-9a-z]*\b'  # x86: vfmadd231ps, vfnmsub..., fmaddss
        ;;
    qemu)
        cxx=aarch64-linux-gnu-g++
        objdump=aarch64-linux-gnu-objdump
        arch_flags=(-march=armv8.2-a+dotprod+i8mm)
        link_flags=(-static)
        run=(qemu-aarch64 -cpu "${QEMU_CPU:-max}")
        fused='\b(fmla|fmls|fmadd|fmsub|fnmadd|fnmsub|bfmla[bt]?)\b'
        for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
            command -v "$tool" >/dev/null || {
                echo "run_harness.sh: $tool not found (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)" >&2
                exit 3
            }
        done
        ;;
    *)
        echo "usage: $0 native|native-vnni|qemu [--isas LIST]" >&2
        exit 2
        ;;
esac

# default build directory: one per user and per checkout (objects of another checkout's sources
# could be newer than this one's)
checkout="$(printf '%s' "$kernels" | cksum | cut -d' ' -f1)"
build="${VSK_HARNESS_BUILD:-${TMPDIR:-/tmp}/verispec-kernel-harness-$(id -u)-$checkout}/$target"
mkdir -p "$build"
jobs="$(nproc 2>/dev/null || echo 2)"

# compile SOURCE OBJECT: when the object is missing or older than the source, core.h or this script
compile() {
    local src="$1" obj="$2"
    if [[ -f "$obj" && "$obj" -nt "$src" && "$obj" -nt "$kernels/core.h" && "$obj" -nt "$here/run_harness.sh" ]]; then
        return 0
    fi
    "$cxx" "${FLAGS[@]}" "${arch_flags[@]}" -I"$kernels" -c "$src" -o "$obj.tmp.$$" && mv "$obj.tmp.$$" "$obj"
}

objects=()
pids=()
for name in "${CORE_SOURCES[@]}" harness.cpp; do
    if [[ "$name" == harness.cpp ]]; then src="$here/harness.cpp"; else src="$kernels/$name"; fi
    obj="$build/${name%.cpp}.o"
    objects+=("$obj")
    compile "$src" "$obj" &
    pids+=($!)
    if (( ${#pids[@]} >= jobs )); then
        wait "${pids[0]}" || { echo "run_harness.sh: compiling failed" >&2; wait; exit 4; }
        pids=("${pids[@]:1}")
    fi
done
for pid in "${pids[@]}"; do
    wait "$pid" || { echo "run_harness.sh: compiling failed" >&2; wait; exit 4; }
done
"$cxx" "${link_flags[@]}" -o "$build/harness" "${objects[@]}"

found="$("$objdump" -d --no-show-raw-insn "${objects[@]:0:${#CORE_SOURCES[@]}}" | grep -E "$fused" || true)"
if [[ -n "$found" ]]; then
    echo "run_harness.sh: fused multiply-add instructions in the kernel objects:" >&2
    echo "$found" | head -20 >&2
    exit 5
fi
if [[ "$target" == qemu ]]; then
    plain="$build/arm_neon_plain.o"
    saved=("${arch_flags[@]}")
    arch_flags=()
    compile "$kernels/arm_neon.cpp" "$plain" || { echo "run_harness.sh: arm_neon.cpp does not build without -march" >&2; exit 4; }
    compile "$kernels/arm_neon_float.cpp" "$build/arm_neon_float_plain.o" \
        || { echo "run_harness.sh: arm_neon_float.cpp does not build without -march" >&2; exit 4; }
    arch_flags=("${saved[@]}")
    # the sdot kernels (DotAcc instances) must hold no i8mm instruction
    i8mm="$("$objdump" -d --no-show-raw-insn "$plain" "$build/arm_neon.o" \
        | awk '/^[0-9a-f]+ <.*>:$/ { dot = ($2 ~ /DotAcc/) } dot && /\t(smmla|ummla|usmmla|usdot|sudot)\t/' || true)"
    if [[ -n "$i8mm" ]]; then
        echo "run_harness.sh: i8mm instructions in the sdot kernels:" >&2
        echo "$i8mm" | head -20 >&2
        exit 5
    fi
fi
echo "built $build/harness ($cxx ${FLAGS[*]} ${arch_flags[*]} ${link_flags[*]}); no fused multiply-add in the kernel objects"

exec "${run[@]}" "$build/harness" "$@"
