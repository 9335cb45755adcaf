// The machine's memory read bandwidth, measured: the floor under any decode
// step is its bytes over this number (see the bandwidth utilisation metric).
#pragma once

#include <cstddef>
#include <memory>

#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/thread_pool.h"

namespace coalesce::engine {

// The measurement, one pass at a time, over a buffer kept between passes: a
// benchmark times a pass right before each pass of what it measures, so
// that both see the machine in the same state (a shared machine's bandwidth
// moves by half between runs minutes apart), and each pass evicts the
// caches, so what follows reads from memory.
class MemoryReadProbe {
 public:
  // `bytes` (256 MiB: far beyond any cache) allocated and written once, as
  // the weights are (huge_page_memory.h: in huge pages where the kernel grants
  // them), so that the floor is what the machine delivers to them.
  explicit MemoryReadProbe(int threads, int streams_per_thread = 8,
                           size_t bytes = size_t{256} << 20);
  ~MemoryReadProbe();
  MemoryReadProbe(const MemoryReadProbe&) = delete;
  MemoryReadProbe& operator=(const MemoryReadProbe&) = delete;

  // Bytes per second of one pass over the buffer.
  double Pass();

 private:
  int threads_, streams_;
  size_t floats_;
  cpu::HugePageMemory buffer_;
  // The threads that read, kept from pass to pass as an engine's are:
  // threads started for each pass made some passes read far slower
  // (docs/performance.md).
  std::unique_ptr<cpu::ThreadPool> pool_;
};

// Bytes per second that `threads` threads read from a buffer far larger than
// the caches (the best of 5 MemoryReadProbe passes; about a tenth of a second), each thread
// reading `streams_per_thread` interleaved streams with software prefetch,
// as a decode step reads weight rows: one stream per core reads well below
// what the memory delivers, so 8 (the default) is the floor's yardstick.
double MeasureMemoryReadBandwidth(int threads, int streams_per_thread = 8);

}  // namespace coalesce::engine
