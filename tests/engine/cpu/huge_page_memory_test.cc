// Huge-page memory (cpu/huge_page_memory.h): buffers carved from huge-page slabs
// come zeroed, aligned and apart; a slab lives as long as a buffer in it and
// is unmapped with its last one; the kernel is asked for huge pages; and,
// under AddressSanitizer, a read past a buffer or after its release is still
// reported although the slab is one mapping.
#include "engine/cpu/huge_page_memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define COALESCE_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COALESCE_TEST_ASAN 1
#endif
#endif

namespace coalesce::engine::cpu {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

HugePageMemory MustAllocate(size_t bytes) {
  absl::StatusOr<HugePageMemory> memory = HugePageMemory::Allocate(bytes);
  EXPECT_TRUE(memory.ok()) << memory.status();
  return memory.ok() ? *std::move(memory) : HugePageMemory();
}

bool AllZero(const HugePageMemory& m) {
  for (size_t i = 0; i < m.size(); ++i) {
    if (m.data()[i] != 0) return false;
  }
  return true;
}

// /sys/kernel/mm/transparent_hugepage/enabled's chosen word ("always",
// "madvise" or "never"), or "" where the kernel has no huge pages.
std::string HugePagesMode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(in, line)) return "";
  const size_t open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos) return "";
  return line.substr(open + 1, close - open - 1);
}

TEST(HugePageMemoryTest, BuffersAreZeroedAlignedAndApart) {
  std::vector<HugePageMemory> buffers;
  const size_t sizes[] = {1, 13, 64, 65, 4096, 207360, 3 * kMiB + 5, 40 * kMiB};
  for (const size_t size : sizes) {
    buffers.push_back(MustAllocate(size));
    const HugePageMemory& m = buffers.back();
    ASSERT_NE(m.data(), nullptr) << size;
    EXPECT_EQ(m.size(), size);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(m.data()) % 64, 0u) << size;
    EXPECT_TRUE(AllZero(m)) << size;
  }
  // Each filled with its own byte: a buffer that overlapped another would
  // hold the later one's.
  for (size_t b = 0; b < buffers.size(); ++b) {
    std::fill_n(buffers[b].data(), buffers[b].size(), static_cast<uint8_t>(b + 1));
  }
  for (size_t b = 0; b < buffers.size(); ++b) {
    for (size_t i = 0; i < buffers[b].size(); ++i) {
      ASSERT_EQ(buffers[b].data()[i], b + 1) << "buffer " << b << " byte " << i;
    }
  }
}

TEST(HugePageMemoryTest, ZeroBytesIsStillABuffer) {
  HugePageMemory m = MustAllocate(0);
  ASSERT_NE(m.data(), nullptr);
  EXPECT_EQ(m.size(), 1u);
  EXPECT_EQ(m.data()[0], 0);
}

TEST(HugePageMemoryTest, AMovedBufferKeepsItsBytesAndTheSourceIsEmpty) {
  HugePageMemory a = MustAllocate(1000);
  a.data()[999] = 7;
  uint8_t* const where = a.data();
  HugePageMemory b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the contract
  EXPECT_EQ(a.size(), 0u);       // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.data(), where);
  EXPECT_EQ(b.data()[999], 7);
  HugePageMemory c = MustAllocate(10);
  c = std::move(b);
  EXPECT_EQ(c.data(), where);
  EXPECT_EQ(c.size(), 1000u);
}

TEST(HugePageMemoryTest, ASlabLivesAsLongAsItsLastBuffer) {
  // Two small buffers share a slab: the first one's release leaves the
  // second readable and writable.
  auto first = std::make_unique<HugePageMemory>(MustAllocate(4096));
  HugePageMemory second = MustAllocate(4096);
  first.reset();
  std::fill_n(second.data(), second.size(), uint8_t{3});
  EXPECT_EQ(second.data()[4095], 3);
}

// The slabs' figures before a test, where the kernel has huge pages and
// smaps can be read; else the test is skipped.
class HugePageUseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (HugePagesMode().empty()) {
      GTEST_SKIP() << "this kernel has no transparent huge pages "
                      "(/sys/kernel/mm/transparent_hugepage/enabled is missing)";
    }
    const std::optional<HugePageUse> use = ReadHugePageUse();
    if (!use.has_value()) GTEST_SKIP() << "/proc/self/smaps cannot be read here";
    before = *use;
  }
  HugePageUse before;
};

TEST_F(HugePageUseTest, SlabsAreAdvisedForHugePagesAndUnmappedWithTheirLastBuffer) {
  {
    // Larger than a slab: a slab of its own, 64 MiB, all of it written.
    HugePageMemory big = MustAllocate(64 * kMiB);
    std::fill_n(big.data(), big.size(), uint8_t{1});
    const std::optional<HugePageUse> during = ReadHugePageUse();
    ASSERT_TRUE(during.has_value());
    EXPECT_GE(during->mapped_bytes - before.mapped_bytes, static_cast<int64_t>(64 * kMiB));
    EXPECT_GE(during->resident_bytes - before.resident_bytes, static_cast<int64_t>(64 * kMiB));
    if (HugePagesMode() != "never") {
      // Granted where the kernel has free 2 MiB pages: with 64 MiB just
      // written, some of them at least.
      EXPECT_GT(during->huge_bytes, before.huge_bytes)
          << "no huge pages granted for 64 MiB of advised memory (mode " << HugePagesMode() << ")";
    }
  }
  const std::optional<HugePageUse> after = ReadHugePageUse();
  ASSERT_TRUE(after.has_value());
  // Unmapped: the advised mappings are as they were (the slab that small
  // buffers come from may have changed, but not by 64 MiB).
  EXPECT_LT(after->mapped_bytes - before.mapped_bytes, static_cast<int64_t>(32 * kMiB));
}

TEST_F(HugePageUseTest, HugePagesRefusedOnRequest) {
  ASSERT_TRUE(HugePagesOn());
  SetHugePages(false);
  {
    HugePageMemory big = MustAllocate(64 * kMiB);
    std::fill_n(big.data(), big.size(), uint8_t{1});
    const std::optional<HugePageUse> during = ReadHugePageUse();
    ASSERT_TRUE(during.has_value());
    // Still a slab (counted), but on 4 KiB pages, whatever the mode.
    EXPECT_GE(during->mapped_bytes - before.mapped_bytes, static_cast<int64_t>(64 * kMiB));
    EXPECT_EQ(during->huge_bytes, before.huge_bytes);
  }
  SetHugePages(true);
  EXPECT_TRUE(HugePagesOn());
}

TEST(HugePageMemoryTest, ThreadsAllocatingTogetherGetBuffersApart) {
  constexpr int kThreads = 4, kEach = 500;
  std::vector<std::vector<HugePageMemory>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &got] {
      for (int i = 0; i < kEach; ++i) {
        absl::StatusOr<HugePageMemory> m = HugePageMemory::Allocate(100 + i);
        if (!m.ok()) return;
        std::fill_n(m->data(), m->size(), static_cast<uint8_t>(t + 1));
        got[t].push_back(*std::move(m));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(got[t].size(), static_cast<size_t>(kEach));
    for (const HugePageMemory& m : got[t]) {
      for (size_t i = 0; i < m.size(); ++i) ASSERT_EQ(m.data()[i], t + 1);
    }
  }
}

#ifdef COALESCE_TEST_ASAN
TEST(HugePageMemoryDeathTest, AReadPastABufferIsReported) {
  HugePageMemory m = MustAllocate(100);
  HugePageMemory next = MustAllocate(100);  // right after it in the slab
  volatile uint8_t* p = m.data();
  EXPECT_DEATH(p[m.size() + 8] = 1, "AddressSanitizer");
}

TEST(HugePageMemoryDeathTest, AReadAfterReleaseIsReported) {
  HugePageMemory keep = MustAllocate(100);  // keeps the slab mapped
  volatile uint8_t* p;
  {
    HugePageMemory m = MustAllocate(100);
    p = m.data();
  }
  EXPECT_DEATH(p[0] = 1, "AddressSanitizer");
}
#endif

}  // namespace
}  // namespace coalesce::engine::cpu
