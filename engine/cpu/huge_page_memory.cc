#include "engine/cpu/huge_page_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

// AddressSanitizer cannot see into the slabs (one mapping, many buffers), so
// they are poisoned by hand: a gap after each buffer, and a released buffer
// while its slab lives on, so that a read past a buffer's end or after its
// release is still reported (past the slab's unmapping, the read faults).
// Never the whole of a slab: poisoning writes an eighth of the bytes'
// worth of shadow.
#if defined(__SANITIZE_ADDRESS__)
#define COALESCE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COALESCE_ASAN 1
#endif
#endif
#ifdef COALESCE_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace coalesce::engine::cpu {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kSlabBytes = size_t{32} << 20;
constexpr size_t kAlign = 64;
#ifdef COALESCE_ASAN
constexpr size_t kGap = 64;  // poisoned, after each buffer
#else
constexpr size_t kGap = 0;
#endif

std::atomic<bool> huge_pages{true};

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

void Poison(const void* p, size_t n) {
#ifdef COALESCE_ASAN
  ASAN_POISON_MEMORY_REGION(p, n);
#else
  (void)p;
  (void)n;
#endif
}
void Unpoison(const void* p, size_t n) {
#ifdef COALESCE_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
  (void)p;
  (void)n;
#endif
}

}  // namespace

struct HugePageMemory::Slab {
  uint8_t* base = nullptr;
  size_t bytes = 0;

  Slab(uint8_t* b, size_t n) : base(b), bytes(n) {}
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  ~Slab() {
    Unpoison(base, bytes);  // for what is mapped here next
    munmap(base, bytes);
  }

  // `bytes` of fresh anonymous memory (zero), 2 MiB aligned: mapped with a
  // huge page to spare, then trimmed at both ends.
  static std::shared_ptr<Slab> Map(size_t bytes) {
    const size_t mapped = bytes + kHugePage;
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    auto* raw = static_cast<uint8_t*>(p);
    auto* base = reinterpret_cast<uint8_t*>(RoundUp(reinterpret_cast<uintptr_t>(raw), kHugePage));
    if (base > raw) munmap(raw, base - raw);
    if (const size_t tail = raw + mapped - (base + bytes); tail > 0) munmap(base + bytes, tail);
    // A hint: where huge pages are off it fails or is ignored, and the slab
    // is ordinary memory.
    madvise(base, bytes, huge_pages.load() ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return std::make_shared<Slab>(base, bytes);
  }
};

namespace {

// The slab that new buffers are carved from, and how much of it they took.
// Held weakly: a slab goes when its last buffer does.
struct Carver {
  std::mutex mu;
  std::weak_ptr<HugePageMemory::Slab> current;
  size_t used = 0;
};

Carver& TheCarver() {
  static Carver* carver = new Carver();  // never destroyed: buffers may outlive main's statics
  return *carver;
}

}  // namespace

void SetHugePages(bool on) {
  Carver& carver = TheCarver();
  std::lock_guard<std::mutex> lock(carver.mu);
  huge_pages.store(on);
  carver.current.reset();  // the next buffer starts a slab advised anew
  carver.used = 0;
}

bool HugePagesOn() { return huge_pages.load(); }

absl::StatusOr<HugePageMemory> HugePageMemory::Allocate(size_t bytes) {
  const size_t size = std::max<size_t>(bytes, 1);
  const size_t span = RoundUp(size, kAlign) + kGap;
  if (span < size) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  Carver& carver = TheCarver();
  std::shared_ptr<Slab> slab;
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(carver.mu);
    slab = carver.current.lock();
    if (slab == nullptr || slab->bytes - carver.used < span) {
      if (span > SIZE_MAX - kHugePage * 2) {
        return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
      }
      slab = Slab::Map(std::max(kSlabBytes, RoundUp(span, kHugePage)));
      if (slab == nullptr) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cannot map ", RoundUp(span, kHugePage), " bytes"));
      }
      carver.current = slab;
      carver.used = 0;
    }
    offset = carver.used;
    carver.used += span;
  }
  HugePageMemory out;
  out.slab_ = std::move(slab);
  out.data_ = out.slab_->base + offset;
  out.size_ = size;
  Poison(out.data_ + size, span - size);  // the rest of its 64 bytes, and the gap
  return out;
}

HugePageMemory::HugePageMemory(HugePageMemory&& other) noexcept
    : slab_(std::move(other.slab_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

HugePageMemory& HugePageMemory::operator=(HugePageMemory&& other) noexcept {
  if (this != &other) {
    Release();
    slab_ = std::move(other.slab_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

HugePageMemory::~HugePageMemory() { Release(); }

void HugePageMemory::Release() {
  // Not when this is the slab's last buffer: it goes now, and a read then
  // faults (the count is a hint under threads: at worst a release is not
  // poisoned, or a slab about to go is).
  if (data_ != nullptr && slab_.use_count() > 1) Poison(data_, size_);
  data_ = nullptr;
  size_ = 0;
  slab_.reset();
}

std::optional<HugePageUse> ReadHugePageUse() {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) return std::nullopt;
  // Each mapping: a header line (its address range), then `Key: value kB`
  // lines, VmFlags last. A mapping's figures count once its flags are read.
  HugePageUse use;
  int64_t size = 0, rss = 0, huge = 0;
  std::string line;
  while (std::getline(smaps, line)) {
    long long kb = 0;
    if (std::sscanf(line.c_str(), "Size: %lld kB", &kb) == 1) {
      size = kb << 10;
    } else if (std::sscanf(line.c_str(), "Rss: %lld kB", &kb) == 1) {
      rss = kb << 10;
    } else if (std::sscanf(line.c_str(), "AnonHugePages: %lld kB", &kb) == 1) {
      huge = kb << 10;
    } else if (line.rfind("VmFlags:", 0) == 0) {
      const std::string flags = line + " ";
      if (flags.find(" hg ") != std::string::npos || flags.find(" nh ") != std::string::npos) {
        use.mapped_bytes += size;
        use.resident_bytes += rss;
        use.huge_bytes += huge;
      }
      size = rss = huge = 0;
    }
  }
  return use;
}

}  // namespace coalesce::engine::cpu
