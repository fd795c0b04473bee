// Writing output files (include/metile/io.h): atomic replacement for regular
// files, written in place for FIFOs and character devices, through the link for
// symlinks, so `--output /dev/stdout`, a named pipe or a link into another folder
// keeps being what it was.
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>
#include <unistd.h>

#include "metile/io.h"

namespace metile {
namespace {

namespace fs = std::filesystem;

// Opens `target` (created or truncated), runs write, flushes; an InputError naming `file` on failure.
void write_stream(const fs::path& target, const std::string& file,
                  const std::function<void(std::ostream&)>& write) {
  std::ofstream stream(target, std::ios::binary | std::ios::trunc);
  if (!stream) throw InputError(file + ": cannot create " + target.string() + ": " + std::strerror(errno));
  write(stream);
  stream.flush();
  if (!stream) throw InputError(file + ": write failed: " + std::strerror(errno));
  stream.close();
  if (!stream) throw InputError(file + ": write failed: " + std::strerror(errno));
}

// Write beside the destination and rename: a reader never sees a half-written file.
void replace_atomically(const fs::path& destination, const std::string& file,
                        const std::function<void(std::ostream&)>& write) {
  fs::path temporary = destination;
  temporary += ".tmp" + std::to_string(::getpid());
  try {
    write_stream(temporary, file, write);
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
  std::error_code error;
  fs::rename(temporary, destination, error);
  if (error) {
    fs::remove(temporary, error);
    throw InputError(file + ": cannot rename " + temporary.string() + " into place: " + error.message());
  }
}

}  // namespace

void write_output_file(const fs::path& path, const std::function<void(std::ostream&)>& write) {
  const std::string file = path.string();
  std::error_code error;
  fs::path destination = path;
  if (fs::is_symlink(fs::symlink_status(path, error))) {
    destination = fs::canonical(path, error);
    // A dangling link: opening it creates its target, which is writing through it.
    if (error) return write_stream(path, file, write);
  }
  const fs::file_status status = fs::status(destination, error);
  switch (status.type()) {
    case fs::file_type::not_found:
    case fs::file_type::regular: return replace_atomically(destination, file, write);
    case fs::file_type::fifo:
    case fs::file_type::character: return write_stream(destination, file, write);
    case fs::file_type::directory: throw InputError(file + ": is a directory");
    default:
      if (error) throw InputError(file + ": cannot write: " + error.message());
      throw InputError(file + ": not a regular file, FIFO or character device; refusing to replace it");
  }
}

}  // namespace metile
