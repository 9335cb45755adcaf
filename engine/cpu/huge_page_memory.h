// Memory that the CPU kernels stream through at every decode step (the
// laid-out weights), backed by transparent huge pages where the kernel
// grants them.
//
// A decode step reads every weight once, front to back, and a 4 KiB page is
// a TLB entry (and a page walk) every 64 cache lines; the processor's own
// prefetcher also stops at each 4 KiB boundary. On a 2 MiB page both go
// away, and a step that reads a few streams a thread, as the one-row
// kernels do, comes nearer the memory's bandwidth more often
// (docs/performance.md). The KV cache stays on ordinary pages: with it on
// huge pages too, decoding at long contexts was no faster in the runs
// measured, and a first write would make 2 MiB of it real at a time.
// A model's matrices are mostly far smaller than 2 MiB (a 576 x 576 Q4_1
// matrix is 207 KB), so each gets no huge page of its own: they are carved
// one after another out of slabs of 32 MiB (or the request rounded up to
// 2 MiB, if larger), 2 MiB aligned, that the kernel is asked to back with
// huge pages (madvise MADV_HUGEPAGE; honoured where
// /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`, and
// a hint otherwise). Space in a slab is never reused: a slab is unmapped
// when the last buffer carved from it goes, as a model's do together. A
// slab's pages are real only where a buffer was written, so its unused
// tail costs address space, not memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"

namespace coalesce::engine::cpu {

class HugePageMemory {
 public:
  // `bytes` zeroed bytes (at least one), 64-byte aligned. ResourceExhausted
  // when the address space cannot be had.
  static absl::StatusOr<HugePageMemory> Allocate(size_t bytes);

  HugePageMemory() = default;
  HugePageMemory(HugePageMemory&& other) noexcept;
  HugePageMemory& operator=(HugePageMemory&& other) noexcept;
  HugePageMemory(const HugePageMemory&) = delete;
  HugePageMemory& operator=(const HugePageMemory&) = delete;
  ~HugePageMemory();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

  struct Slab;

 private:
  void Release();

  std::shared_ptr<Slab> slab_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Whether slabs mapped from now on ask for huge pages (true, the default)
// or refuse them (MADV_NOHUGEPAGE, even where the kernel would give them
// unasked): for benchmarks that compare. The buffers already carved keep
// their pages.
void SetHugePages(bool on);
bool HugePagesOn();

// The weight slabs, as /proc/self/smaps shows them: the process's mappings
// advised for huge pages or against them (VmFlags `hg` or `nh`: nothing
// else in coalesce advises either): their size, the bytes of them in
// memory, and the bytes of those the kernel backs with huge pages
// (AnonHugePages). Fewer huge bytes than resident ones mean the kernel had
// no free 2 MiB pages, huge pages are off (`never`) or refused
// (SetHugePages). nullopt where smaps cannot be read.
struct HugePageUse {
  int64_t mapped_bytes = 0;
  int64_t resident_bytes = 0;
  int64_t huge_bytes = 0;
};
std::optional<HugePageUse> ReadHugePageUse();

}  // namespace coalesce::engine::cpu
