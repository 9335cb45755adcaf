"""The CPU kernels that ask for memory ahead still do, in the built objects.

GCC 12 drops a call whose only effect is a prefetch unless the call is
inlined (the quantized one-row kernels and the float32 panel tiles once lost
every prefetch that way, silently). This disassembles the kernels' objects
and checks that each kernel family named below holds prefetch instructions.

Usage: kernel_prefetches.py OBJDUMP OBJECT... (or one ;-separated list)
"""

import re
import subprocess
import sys

# Kernel families: (description, pattern a function name must match); in
# each object at least one such function must prefetch.
QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]  # engine/model.h's order


def families():
    out = []
    for n, name in enumerate(QUANT_TYPES):
        out.append((f"quantized one-row product, {name}",
                    re.compile(rf"(RunsOf|FewRowsPanels)<\(coalesce::engine::QuantType\){n}\b")))
    # The tiles, inlined into the packing product or not (both products,
    # packed as they run or laid out at load, run them).
    out.append(("float32 panel tiles", re.compile(r"MatmulPanelsWith<|Kernel::Tile<")))
    return out


def prefetching_functions(objdump, path):
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", path], check=True,
                          capture_output=True, text=True).stdout
    names, current = set(), None
    header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
    for line in text.splitlines():
        m = header.match(line)
        if m:
            current = m.group(1)
        elif current is not None and "prefetch" in line:
            names.add(current)
    return names


def main():
    # CMake passes the objects as one ;-separated list.
    objdump = sys.argv[1]
    objects = [p for arg in sys.argv[2:] for p in arg.split(";") if p]
    failures, checked = [], 0
    for suffix in ("kernels.cc.o", "kernels_avx512.cc.o"):
        paths = [p for p in objects if p.endswith("/" + suffix)]
        if len(paths) != 1:
            failures.append(f"expected one {suffix} among the objects, found {len(paths)}")
            continue
        names = prefetching_functions(objdump, paths[0])
        for what, pattern in families():
            checked += 1
            if not any(pattern.search(n) for n in names):
                failures.append(f"{suffix}: no prefetch in the {what} ({pattern.pattern})")
    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print(f"ok: {checked} kernel families prefetch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
