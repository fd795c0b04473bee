// The on-disk NVRTC cache: a second compile is served from the cache, and a damaged entry
// (flipped byte, truncation, foreign file) is detected by its checksum header and rebuilt.
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>

#include "metile/cuda_runtime.h"
#include "metile_test_support.h"

namespace metile {
namespace {

constexpr const char* kernel_source = R"(
extern "C" __global__ void metile_cache_probe(float* out, float factor) {
  out[threadIdx.x] *= factor;
}
)";

class KernelCache : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device entropy;
    directory_ = std::filesystem::temp_directory_path() / ("metile-cache-test-" + std::to_string(entropy()));
    const char* previous = std::getenv("METILE_CACHE_DIR");
    if (previous != nullptr) previous_ = previous;
    setenv("METILE_CACHE_DIR", directory_.c_str(), 1);
    options_.architecture = "sm_90";
    // A unique define per test run, so an entry from an earlier run can never answer.
    options_.extra = {"-DMETILE_CACHE_TEST_TAG=" + std::to_string(entropy())};
  }
  void TearDown() override {
    if (previous_) {
      setenv("METILE_CACHE_DIR", previous_->c_str(), 1);
    } else {
      unsetenv("METILE_CACHE_DIR");
    }
    std::filesystem::remove_all(directory_);
  }

  CompiledProgram compile() { return compile_cuda_program(kernel_source, "metile_cache_probe", options_); }

  std::filesystem::path directory_;
  std::optional<std::string> previous_;
  CompileOptions options_;
};

TEST_F(KernelCache, SecondCompileComesFromTheCache) {
  const CompiledProgram first = compile();
  EXPECT_FALSE(first.from_cache);
  EXPECT_TRUE(std::filesystem::exists(kernel_cache_path(first.cache_key)));
  EXPECT_EQ(std::filesystem::path(kernel_cache_path(first.cache_key)).parent_path(), directory_ / "kernels");
  const CompiledProgram second = compile();
  EXPECT_TRUE(second.from_cache);
  EXPECT_EQ(second.cubin, first.cubin);
  EXPECT_EQ(second.cache_key, first.cache_key);
  // Another architecture is another entry.
  options_.architecture = "sm_80";
  const CompiledProgram other = compile();
  EXPECT_FALSE(other.from_cache);
  EXPECT_NE(other.cache_key, first.cache_key);
}

TEST_F(KernelCache, CorruptEntriesAreDetectedAndRebuilt) {
  const CompiledProgram original = compile();
  const std::filesystem::path path = kernel_cache_path(original.cache_key);
  auto read_file = [&] {
    std::ifstream file(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  };
  auto write_file = [&](const std::string& bytes) {
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file << bytes;
  };
  const std::string intact = read_file();
  ASSERT_GT(intact.size(), original.cubin.size());

  std::string flipped = intact;
  flipped[flipped.size() - 100] = static_cast<char>(flipped[flipped.size() - 100] ^ 0x5a);
  const std::string truncated = intact.substr(0, intact.size() / 2);
  const std::string foreign = "not a metile cache entry\n" + original.cubin;
  for (const std::string& damaged : {flipped, truncated, foreign, std::string()}) {
    write_file(damaged);
    const CompiledProgram rebuilt = compile();
    EXPECT_FALSE(rebuilt.from_cache);
    EXPECT_TRUE(rebuilt.rebuilt_corrupt_cache_entry);
    EXPECT_EQ(rebuilt.cubin, original.cubin);
    EXPECT_EQ(read_file(), intact) << "the damaged entry is replaced by a good one";
    EXPECT_TRUE(compile().from_cache);
  }
}

// An intact entry of another program, copied or renamed into this entry's place, passed the size and
// checksum checks and was served: the other kernel ran under this one's key (a NVRTC program whose
// kernel name is not in the cubin fails to load; one that shares the name loads the wrong code). The
// header names its entry now.
TEST_F(KernelCache, AnotherEntrysFileInThisPlaceIsRebuiltNotServed) {
  const CompiledProgram original = compile();
  options_.architecture = "sm_80";
  const CompiledProgram other = compile();
  options_.architecture = "sm_90";
  ASSERT_NE(other.cubin, original.cubin);
  const std::filesystem::path path = kernel_cache_path(original.cache_key);
  std::filesystem::copy_file(kernel_cache_path(other.cache_key), path, std::filesystem::copy_options::overwrite_existing);
  const CompiledProgram rebuilt = compile();
  EXPECT_FALSE(rebuilt.from_cache);
  EXPECT_TRUE(rebuilt.rebuilt_corrupt_cache_entry);
  EXPECT_EQ(rebuilt.cubin, original.cubin);
  EXPECT_TRUE(compile().from_cache);
}

// A FIFO in an entry's place blocked the compile forever (opened for reading, it waits for a writer),
// and a link to /dev/zero was read line by line without end (the header line never ends). Neither is
// opened now: each is a corrupt entry, rebuilt and replaced by a regular file.
TEST_F(KernelCache, SpecialFilesInAnEntrysPlaceAreRebuiltNotOpened) {
  const CompiledProgram original = compile();
  const std::filesystem::path path = kernel_cache_path(original.cache_key);
  for (const bool fifo : {true, false}) {
    SCOPED_TRACE(fifo ? "a FIFO" : "a link to /dev/zero");
    std::filesystem::remove(path);
    if (fifo) {
      ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
    } else {
      std::filesystem::create_symlink("/dev/zero", path);
    }
    CompiledProgram rebuilt;
    EXPECT_TRUE(metile::testing::returns_without_opening_fifo(path, [&] { rebuilt = compile(); }));
    EXPECT_FALSE(rebuilt.from_cache);
    EXPECT_TRUE(rebuilt.rebuilt_corrupt_cache_entry);
    EXPECT_EQ(rebuilt.cubin, original.cubin);
    EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::symlink_status(path)));
    EXPECT_TRUE(compile().from_cache);
  }
}

TEST_F(KernelCache, CompileErrorsNameTheKernelAndCarryTheLog) {
  try {
    compile_cuda_program("extern \"C\" __global__ void broken() { undefined_name(); }", "broken", options_);
    FAIL() << "expected a compile error";
  } catch (const CudaError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("nvrtcCompileProgram(broken, sm_90)"), std::string::npos) << message;
    EXPECT_NE(message.find("undefined_name"), std::string::npos) << message;
  }
}

TEST(StableHash, IsDeterministicAndSensitive) {
  // The on-disk kernel cache is keyed by it, so it must be the same in every run and build: a pinned
  // value, computed independently (FNV-1a 64 with the seed xor-ed into the offset basis, then the
  // splitmix64 finalizer, seeds 0 and 0x9e3779b97f4a7c15, in Python).
  EXPECT_EQ(stable_hash_hex("metile"), "0cc429a990012a5bbb4ed4c44a2be33a");
  EXPECT_EQ(stable_hash_hex("metile").size(), 32u);
  EXPECT_NE(stable_hash_hex("metile"), stable_hash_hex("metilf"));
  EXPECT_NE(stable_hash_hex(""), stable_hash_hex(std::string(1, '\0')));
}

}  // namespace
}  // namespace metile

// Without HOME (cron, a service) the cache was a shared /tmp/metile-cache whose kernels another user could
// have put there; it is now the account's home from the password database (and only where there is none a
// /tmp folder of the user's own). METILE_CACHE_DIR and HOME still come first.
TEST(CacheDirectory, WithoutHomeItIsTheAccountsHome) {
  const auto saved = [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    return value != nullptr ? std::optional<std::string>(value) : std::nullopt;
  };
  const std::optional<std::string> home = saved("HOME"), cache = saved("METILE_CACHE_DIR");
  ::unsetenv("METILE_CACHE_DIR");
  ::setenv("HOME", "/somewhere", 1);
  EXPECT_EQ(metile::cache_directory(), "/somewhere/.cache/metile");
  ::setenv("METILE_CACHE_DIR", "/elsewhere", 1);
  EXPECT_EQ(metile::cache_directory(), "/elsewhere");
  ::unsetenv("METILE_CACHE_DIR");
  ::unsetenv("HOME");
  const passwd* account = ::getpwuid(::getuid());
  ASSERT_NE(account, nullptr);
  const std::string account_home = account->pw_dir;
  const std::string expected = account_home.starts_with("/") && account_home != "/"
                                   ? account_home + "/.cache/metile"
                                   : "/tmp/metile-cache-" + std::to_string(::getuid());
  EXPECT_EQ(metile::cache_directory(), expected);
  ::setenv("HOME", "", 1);  // empty is unset
  EXPECT_EQ(metile::cache_directory(), expected);
  if (home) ::setenv("HOME", home->c_str(), 1); else ::unsetenv("HOME");
  if (cache) ::setenv("METILE_CACHE_DIR", cache->c_str(), 1);
}
