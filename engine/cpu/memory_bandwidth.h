// The machine's memory read bandwidth, measured: the floor under any decode
// step is its bytes over this number (see the bandwidth utilisation metric).
#pragma once

namespace coalesce::engine {

// Bytes per second that `threads` threads read from a buffer far larger than
// the caches (best of 5 passes; about a tenth of a second), each thread
// reading `streams_per_thread` interleaved streams with software prefetch,
// as a decode step reads weight rows: one stream per core reads well below
// what the memory delivers, so 8 (the default) is the floor's yardstick.
double MeasureMemoryReadBandwidth(int threads, int streams_per_thread = 8);

}  // namespace coalesce::engine
