"""The _metile extension exports its entry point and nothing else (python/bindings/exports.map).

Why it matters: a compiler that links libstdc++ statically into shared objects (the GPU machine's image has one) put
an exported copy of libstdc++'s locale ids and stream members into the module, and in a process where numpy had
loaded the system libstdc++ first, the dynamic linker bound the two copies' halves to each other: the first formatted
write crashed (notes/gpu_check.md, sessions 54-55). With nothing but PyInit__metile exported, no copy of anything in
the module can be bound against another library's, whichever compiler built it.
"""
import shutil
import subprocess
import sys

import pytest

import metile


def test_the_extension_exports_its_entry_point_only():
    nm = shutil.which("nm")
    if nm is None or sys.platform != "linux":
        pytest.skip("needs binutils' nm on Linux")
    listing = subprocess.run([nm, "-D", "--defined-only", metile._metile.__file__], capture_output=True, text=True,
                             check=True).stdout
    exported = sorted(line.split()[-1] for line in listing.splitlines() if line.strip())
    assert exported == ["PyInit__metile"], f"{len(exported)} exported symbols, among them {exported[:8]}"
