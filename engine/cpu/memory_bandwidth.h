// The machine's memory read bandwidth, measured: the floor under any decode
// step is its bytes over this number (see the bandwidth utilisation metric).
#pragma once

namespace coalesce::engine {

// Bytes per second that `threads` threads read from a buffer far larger than
// the caches (best of a few passes; about a tenth of a second).
double MeasureMemoryReadBandwidth(int threads);

}  // namespace coalesce::engine
