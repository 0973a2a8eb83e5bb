#!/usr/bin/env bash
# No instruction of an ISA that Highway's dispatch does not check for.
#
# Highway 1.0.3 selects AVX3_DL on AVX-512 VNNI + VBMI2 + ... (Ice Lake, Zen 4)
# but compiles that target with -mavxvnni, so GCC may encode a 256- or 128-bit
# VNNI intrinsic, or a loop it vectorises, with VEX (AVX-VNNI, only from Alder
# Lake / Sapphire Rapids / Zen 5 on): SIGILL on the CPUs the target was chosen
# for. A test of the kernels on the machine that builds them passes wherever
# that machine has AVX-VNNI; this one reads the code and fails on any CPU.
#   tests/no_vex_vnni.sh BINARY...
set -euo pipefail
command -v objdump > /dev/null || { echo "no_vex_vnni: objdump (binutils) not found" >&2; exit 1; }
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
bad=0
for f in "$@"; do
  [ -s "$f" ] || { echo "no_vex_vnni: $f: no such file" >&2; exit 1; }
  # VEX-only: AVX-VNNI ({vex} vpdp*), AVX-IFMA ({vex} vpmadd52*), AVX-VNNI-INT8/16 (vpdpb??d, vpdpw??d other than wssd).
  hits=$(objdump -d --no-show-raw-insn "$f" | awk '
    /^[0-9a-f]+ <.*>:$/ { fn = $2 }
    /\{vex\} vpdp|\{vex\} vpmadd52|vpdpb(ss|su|uu)ds? |vpdpw(su|us|uu)ds? / { n[fn]++ }
    END { for (k in n) print n[k], k }')
  if [ -n "$hits" ]; then
    echo "no_vex_vnni: $f holds instructions its CPU check does not guarantee (count, function):" >&2
    echo "$hits" | sort -rn | head -20 >&2
    bad=1
  else
    echo "no_vex_vnni: $f: none"
  fi
done
exit $bad
