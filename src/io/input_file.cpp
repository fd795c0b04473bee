// Reading input files within a size limit (include/metile/io.h). The limit is
// checked before reading a regular file and while reading a special one, so
// /dev/zero or an endless FIFO ends in one InputError instead of bad_alloc.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <limits>
#include <system_error>
#include <unistd.h>

#include "metile/io.h"

namespace metile {
namespace {

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

[[noreturn]] void too_large(const std::string& file, std::uint64_t maximum_bytes, std::string_view what) {
  throw InputError(file + ": larger than the " + std::to_string(maximum_bytes) + "-byte limit for " +
                   std::string(what) + " files");
}

void refuse_directory(const std::filesystem::path& path, std::string_view what) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    throw InputError(path.string() + ": is a directory, not a " + std::string(what) + " file");
  }
}

}  // namespace

std::string read_input_file(const std::filesystem::path& path, std::uint64_t maximum_bytes, std::string_view what) {
  const std::string file = path.string();
  refuse_directory(path, what);
  std::unique_ptr<std::FILE, FileCloser> stream(std::fopen(file.c_str(), "rb"));
  if (!stream) throw InputError(file + ": cannot open the file: " + std::strerror(errno));
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) {
    const std::uintmax_t size = std::filesystem::file_size(path, error);
    if (!error && size > maximum_bytes) too_large(file, maximum_bytes, what);
  }
  std::string text;
  char chunk[1 << 16];
  while (true) {
    const std::size_t read = std::fread(chunk, 1, sizeof(chunk), stream.get());
    if (read > maximum_bytes - text.size()) too_large(file, maximum_bytes, what);
    text.append(chunk, read);
    if (read < sizeof(chunk)) break;
  }
  if (std::ferror(stream.get())) throw InputError(file + ": cannot read the file: " + std::strerror(errno));
  return text;
}

std::uint64_t regular_file_size(const std::filesystem::path& path, std::string_view what) {
  const std::string file = path.string();
  refuse_directory(path, what);
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (error || !std::filesystem::exists(status)) {
    throw InputError(file + ": cannot open the file: " + (error ? error.message() : std::string("No such file or directory")));
  }
  if (!std::filesystem::is_regular_file(status)) {
    throw InputError(file + ": not a regular file (a " + std::string(what) + " file is read by offset)");
  }
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  if (error) throw InputError(file + ": cannot read the file size: " + error.message());
  return size;
}

std::filesystem::file_status input_path_status(const std::filesystem::path& path, bool follow_symlinks) {
  std::error_code error;
  const std::filesystem::file_status status =
      follow_symlinks ? std::filesystem::status(path, error) : std::filesystem::symlink_status(path, error);
  // A missing file comes back as not_found with the error set; anything else that set it is type none.
  if (status.type() == std::filesystem::file_type::none) throw InputError(path.string() + ": " + error.message());
  return status;
}

std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return std::numeric_limits<std::uint64_t>::max();
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_size);
}

}  // namespace metile
