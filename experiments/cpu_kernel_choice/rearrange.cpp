// The CPU receive kernel (backends/kvhost_cpu/kernels.py: rearrange_units) written again in
// C++ with OpenMP, for one purpose: to compare kernel technologies on the same job, with
// the same parameters and the same algorithm. kvhost does not ship or load it.
//
// Work item = one unit (a local block, or a group of them) of one tensor's outer index.
// Each piece of a unit goes to a small per-thread scratch and is written back through the
// loops of the rearrangement: one read and one write of every byte.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kShortRun = 1024;  // runs up to this many bytes are copied inline
constexpr int64_t kSkew = 2048;      // scratch and region differ by this modulo 4 KiB

struct Loops {
  int64_t shape[6];
  int64_t src[6];
  int64_t dst[6];
};

inline void copy_run(char* dst, const char* src, int64_t nbytes) {
  if (nbytes <= kShortRun && nbytes % 32 == 0) {
    for (int64_t offset = 0; offset < nbytes; offset += 32) std::memcpy(dst + offset, src + offset, 32);
  } else {
    std::memcpy(dst, src, nbytes);
  }
}

// For every index of the six-dim shape, copy `run` bytes; the outer four dims by one flat
// counter, as the numba kernel does.
inline void strided_copy(char* dst, const char* src, const Loops& loops, int64_t run) {
  const int64_t* shape = loops.shape;
  const int64_t outer = shape[0] * shape[1] * shape[2] * shape[3];
  for (int64_t flat = 0; flat < outer; ++flat) {
    const int64_t i3 = flat % shape[3];
    int64_t rest = flat / shape[3];
    const int64_t i2 = rest % shape[2];
    rest /= shape[2];
    const int64_t i1 = rest % shape[1];
    const int64_t i0 = rest / shape[1];
    char* d = dst + i0 * loops.dst[0] + i1 * loops.dst[1] + i2 * loops.dst[2] + i3 * loops.dst[3];
    const char* s = src + i0 * loops.src[0] + i1 * loops.src[1] + i2 * loops.src[2] + i3 * loops.src[3];
    for (int64_t i4 = 0; i4 < shape[4]; ++i4) {
      char* d4 = d + i4 * loops.dst[4];
      const char* s4 = s + i4 * loops.src[4];
      for (int64_t i5 = 0; i5 < shape[5]; ++i5) copy_run(d4 + i5 * loops.dst[5], s4 + i5 * loops.src[5], run);
    }
  }
}

// Same packing as kernels.receive_params: six scalars, then shape, source strides (the
// scratch side) and destination strides (the cache side), six each.
struct Params {
  int64_t block_stride, region_bytes, pieces, piece_bytes, part_stride, run;
  Loops loops;
  explicit Params(const int64_t* p)
      : block_stride(p[0]), region_bytes(p[1]), pieces(p[2]), piece_bytes(p[3]), part_stride(p[4]), run(p[5]) {
    for (int i = 0; i < 6; ++i) {
      loops.shape[i] = p[6 + i];
      loops.src[i] = p[12 + i];
      loops.dst[i] = p[18 + i];
    }
  }
};

inline char* skewed(char* start, intptr_t address) {
  return start + ((address - reinterpret_cast<intptr_t>(start) + kSkew) & 4095);
}

void rearrange_span(const int64_t* bases, const int64_t* outer, int64_t n_outer, const int64_t* unit_ids,
                    int64_t units, int64_t parts, const Params& p, int64_t first, int64_t last) {
  const int64_t per_tensor = n_outer * units;
  const int64_t span = p.pieces == 1 ? parts : 1;  // regions one piece covers
  std::vector<char> scratch_memory(p.piece_bytes + 4096);
  char* start = scratch_memory.data();
  for (int64_t item = first; item < last; ++item) {
    const int64_t unit = item % units;
    const intptr_t origin = bases[item / per_tensor] + outer[(item / units) % n_outer];
    const int64_t* ids = unit_ids + unit * parts;
    if (span == 1) {
      for (int64_t piece = 0; piece < p.pieces; ++piece) {
        const int64_t offset = piece * p.piece_bytes;
        const intptr_t address = origin + ids[offset / p.region_bytes] * p.block_stride + offset % p.region_bytes;
        char* base = skewed(start, address);
        std::memcpy(base, reinterpret_cast<const char*>(address), p.piece_bytes);
        strided_copy(reinterpret_cast<char*>(address), base, p.loops, p.run);
      }
    } else {
      char* base = skewed(start, origin + ids[0] * p.block_stride);
      for (int64_t k = 0; k < parts; ++k)
        std::memcpy(base + k * p.region_bytes, reinterpret_cast<const char*>(origin + ids[k] * p.block_stride),
                    p.region_bytes);
      for (int64_t k = 0; k < parts; ++k)
        strided_copy(reinterpret_cast<char*>(origin + ids[k] * p.block_stride), base + k * p.part_stride, p.loops,
                     p.run);
    }
  }
}

}  // namespace

extern "C" void rearrange_units(const int64_t* bases, int64_t n_bases, const int64_t* outer, int64_t n_outer,
                                const int64_t* unit_ids, int64_t units, int64_t parts, const int64_t* params,
                                int64_t threads) {
  const Params p(params);
  const int64_t items = n_bases * n_outer * units;
  if (threads <= 1) {
    rearrange_span(bases, outer, n_outer, unit_ids, units, parts, p, 0, items);
    return;
  }
  const int64_t workers = std::min(threads, std::max<int64_t>(items, 1));
  const int64_t share = (items + workers - 1) / workers;
#pragma omp parallel for num_threads(workers) schedule(static, 1)
  for (int64_t worker = 0; worker < workers; ++worker)
    rearrange_span(bases, outer, n_outer, unit_ids, units, parts, p, worker * share,
                   std::min(items, (worker + 1) * share));
}
