#include "common/flags.h"

#include <string>

#include "gtest/gtest.h"

namespace coalesce {
namespace {

TEST(FlagSourcePathTest, OurSourcesAreNamedFromTheRepositoryRoot) {
  const std::string main_cc = std::string(COALESCE_SOURCE_DIR) + "/service/main.cc";
  EXPECT_EQ(FlagSourcePath(main_cc), "service/main.cc");
  EXPECT_TRUE(IsOwnFlagSource(FlagSourcePath(main_cc)));
  const std::string cli = std::string(COALESCE_SOURCE_DIR) + "/tools/cli/coalesce_cli.cc";
  EXPECT_EQ(FlagSourcePath(cli), "tools/cli/coalesce_cli.cc");
  EXPECT_TRUE(IsOwnFlagSource(FlagSourcePath(cli)));
}

TEST(FlagSourcePathTest, OtherSourcesKeepTheirPathAndAreNotListed) {
  // Abseil's own flags (--flagfile, --help, ...), wherever they were built.
  EXPECT_EQ(FlagSourcePath("/build/abseil/absl/flags/parse.cc"),
            "build/abseil/absl/flags/parse.cc");
  EXPECT_FALSE(IsOwnFlagSource(FlagSourcePath("/build/abseil/absl/flags/parse.cc")));
  EXPECT_FALSE(IsOwnFlagSource(FlagSourcePath("absl/flags/parse.cc")));
  // A folder that merely begins like the repository's root is not inside it.
  const std::string sibling = std::string(COALESCE_SOURCE_DIR) + "-old/service/main.cc";
  EXPECT_EQ(FlagSourcePath(sibling), sibling.substr(sibling.find_first_not_of('/')));
  EXPECT_FALSE(IsOwnFlagSource(FlagSourcePath(sibling)));
}

}  // namespace
}  // namespace coalesce
