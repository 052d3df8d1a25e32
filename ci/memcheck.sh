#!/usr/bin/env bash
# Memory checks for the CPU backend's kernels, which work on raw addresses: memory used after
# it was freed must fail a run, not pass it by luck.
#
#   bash ci/memcheck.sh               # ~2 min: the suites that drive the kernels, under a strict
#                                     # glibc malloc, then with numba's bounds checks (ci/cpu.sh runs this)
#   bash ci/memcheck.sh --valgrind    # then valgrind memcheck over ci/memcheck_kernels.py as well:
#                                     # 15 min on a 2-core machine, so not in CI
#   bash ci/memcheck.sh -- -k copy    # extra pytest arguments for both parts
#
# Strict malloc (glibc >= 2.34; elsewhere this part only runs the tests): a chunk of 4 KiB or
# more that malloc cannot carve from memory it already holds gets a mapping of its own,
# unmapped on free (a fixed threshold: glibc's default one rises to the largest chunk freed so
# far); the heap grows by what is asked and gives its top back on every free, so little is held
# to carve from; freed chunks are overwritten with 0xa5; and libc_malloc_debug checks the heap on
# every call (glibc.malloc.check=3), aborting on a corrupted chunk. A write through freed memory
# then faults or leaves wrong bytes that the conformance oracle reports. tests/test_large_pieces.py
# runs its workers with the same settings (without the debug library).
#
# valgrind reports every read or write of freed memory whatever its size; the focused script
# runs once natively first, so that numba loads its cached kernels under valgrind instead of
# compiling them there. PYTHONMALLOC=malloc lets valgrind see Python's own allocations.
set -euo pipefail
cd "$(dirname "$0")/.."

valgrind=0
if [[ "${1:-}" == "--valgrind" ]]; then
    valgrind=1
    shift
fi
[[ "${1:-}" == "--" ]] && shift

make setup >/dev/null

STRICT="glibc.malloc.mmap_threshold=4096:glibc.malloc.top_pad=0:glibc.malloc.trim_threshold=0:glibc.malloc.perturb=165"
preload=""
debug_library=$(/sbin/ldconfig -p 2>/dev/null | awk '/libc_malloc_debug\.so\.0/ { print $NF; exit }') || true
if [[ -n "$debug_library" ]]; then
    preload="$debug_library"
    STRICT="glibc.malloc.check=3:$STRICT"
else
    echo "memcheck: libc_malloc_debug.so not found: heap checks off, strict allocation only"
fi

# The suites that drive the kernels (test_backends also calls their helpers directly).
suites=(tests/test_receive.py tests/test_copy.py tests/test_property.py tests/test_threads.py
    tests/test_errors.py tests/test_vllm_adapter.py tests/test_backends.py)

echo "memcheck: the CPU kernels' suites under GLIBC_TUNABLES=$STRICT${preload:+ (LD_PRELOAD=$preload)}"
LD_PRELOAD="$preload" GLIBC_TUNABLES="$STRICT" .venv/bin/python -X faulthandler -m pytest -q -p no:cacheprovider \
    "${suites[@]}" "$@"

# The kernels index their arrays (ids, offsets, parameters, runs) without bounds checks; here
# numba compiles them with checks, into a cache of their own (the kernels cached without checks
# would otherwise be loaded), so an index past an array's end raises instead of reading on.
checked_cache=$(mktemp -d -t kvhost-numba-boundscheck.XXXXXX)
echo "memcheck: the same suites' kernels compiled with NUMBA_BOUNDSCHECK=1"
NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR="$checked_cache" .venv/bin/python -X faulthandler -m pytest -q -p no:cacheprovider \
    "${suites[@]}" "$@" ||
    { rm -rf "$checked_cache"; exit 1; }
rm -rf "$checked_cache"

if [[ $valgrind == 1 ]]; then
    command -v valgrind >/dev/null || { echo "memcheck: valgrind is not installed" >&2; exit 1; }
    .venv/bin/python ci/memcheck_kernels.py >/dev/null  # warms numba's cache
    log=$(mktemp -t kvhost-valgrind.XXXXXX)
    echo "memcheck: valgrind memcheck over ci/memcheck_kernels.py (log: $log)"
    status=0
    PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 --undef-value-errors=no --leak-check=no \
        --error-limit=no --suppressions=ci/valgrind.supp --log-file="$log" \
        .venv/bin/python ci/memcheck_kernels.py || status=$?
    grep "ERROR SUMMARY" "$log" || true
    if [[ $status != 0 ]]; then
        grep -m 5 -A 12 -E "Invalid (read|write)" "$log" || true
        echo "memcheck: valgrind found errors (exit $status); the whole report is in $log" >&2
        exit "$status"
    fi
fi
