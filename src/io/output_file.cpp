// Writing output files (include/metile/io.h): atomic replacement for regular
// files, written in place for FIFOs and character devices, at the link's target for
// symlinks (a dangling link's too), so a named pipe or a link into another folder keeps being what it was;
// `/dev/stdout` and the other names of a descriptor this process holds open are
// written through that descriptor, at its offset, whatever file it is. A fatal signal's handler
// (remove_temporary_files_on_fatal_signals) unlinks the temporaries being written.
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <streambuf>
#include <string>
#include <system_error>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "metile/io.h"

namespace metile {
namespace {

namespace fs = std::filesystem;

// Opens `target` (created or truncated), runs write, flushes; an InputError naming `file` when it cannot be
// created, a WriteError when a write fails.
void write_stream(const fs::path& target, const std::string& file,
                  const std::function<void(std::ostream&)>& write) {
  std::ofstream stream(target, std::ios::binary | std::ios::trunc);
  if (!stream) throw_write_failure(file + ": cannot create " + target.string() + ": " + std::strerror(errno), errno);
  write(stream);
  stream.flush();
  if (!stream) throw WriteError(file + ": write failed: " + std::strerror(errno));
  stream.close();
  if (!stream) throw WriteError(file + ": write failed: " + std::strerror(errno));
}

// The descriptor a path names when it is one of this process's own (/dev/stdout, /dev/stderr,
// /dev/fd/N, /proc/self/fd/N); -1 otherwise. Resolving such a name reaches the file behind the
// descriptor: a regular file there (stdout redirected with `>>`) would be replaced by a new one,
// losing what was written before, instead of written at the descriptor's offset.
int own_descriptor(const fs::path& path) {
  const std::string text = path.string();
  if (text == "/dev/stdout") return 1;
  if (text == "/dev/stderr") return 2;
  for (const std::string_view prefix : {std::string_view("/dev/fd/"), std::string_view("/proc/self/fd/")}) {
    if (!text.starts_with(prefix) || text.size() == prefix.size()) continue;
    int descriptor = -1;
    const char* const end = text.data() + text.size();
    const auto [at, error] = std::from_chars(text.data() + prefix.size(), end, descriptor);
    if (error == std::errc() && at == end && descriptor >= 0) return descriptor;
  }
  return -1;
}

// A stream buffer over a descriptor this process holds: writes go where the descriptor points,
// in 64 KiB pieces, each retried until whole; the descriptor stays open.
class DescriptorBuffer : public std::streambuf {
 public:
  explicit DescriptorBuffer(int descriptor) : descriptor_(descriptor) { setp(buffer_, buffer_ + sizeof buffer_); }
  ~DescriptorBuffer() override { sync(); }

 protected:
  int_type overflow(int_type c) override {
    if (sync() != 0) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override {
    const char* next = pbase();
    while (next < pptr()) {
      const ssize_t written = ::write(descriptor_, next, static_cast<std::size_t>(pptr() - next));
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) return -1;
      next += written;
    }
    setp(buffer_, buffer_ + sizeof buffer_);
    return 0;
  }

 private:
  int descriptor_;
  char buffer_[1 << 16];
};

void write_descriptor(int descriptor, const std::string& file, const std::function<void(std::ostream&)>& write) {
  if (::fcntl(descriptor, F_GETFD) < 0) throw InputError(file + ": cannot write: " + std::strerror(errno));
  auto buffer = std::make_unique<DescriptorBuffer>(descriptor);
  std::ostream stream(buffer.get());
  write(stream);
  stream.flush();
  if (!stream) throw WriteError(file + ": write failed: " + std::strerror(errno));
}

// The temporaries being written, for a fatal signal's handler to unlink: fixed slots of path bytes, so
// that the handler touches no allocation and calls only unlink (async-signal-safe). A slot is claimed
// (1), filled, published (2) and released (0); the handler takes a published one (3) before it unlinks
// it, so that no thread releases and refills it meanwhile (a taken slot stays taken: the process is
// dying).
constexpr int kTemporarySlots = 8;
constexpr std::size_t kTemporaryPathBytes = 4096;
struct TemporarySlot {
  std::atomic<int> state{0};
  char path[kTemporaryPathBytes] = {};
};
TemporarySlot temporary_slots[kTemporarySlots];
static_assert(std::atomic<int>::is_always_lock_free);

// Holds one temporary's path in a slot while it lives (none when every slot is taken or the path is
// too long: that file is then only removed by the normal paths, as before).
class RegisteredTemporary {
 public:
  explicit RegisteredTemporary(const fs::path& path) {
    const std::string& text = path.native();
    if (text.size() >= kTemporaryPathBytes) return;
    for (TemporarySlot& candidate : temporary_slots) {
      int free = 0;
      if (!candidate.state.compare_exchange_strong(free, 1)) continue;
      std::memcpy(candidate.path, text.c_str(), text.size() + 1);
      candidate.state.store(2);
      slot_ = &candidate;
      return;
    }
  }
  ~RegisteredTemporary() {
    int published = 2;
    if (slot_ != nullptr) slot_->state.compare_exchange_strong(published, 0);
  }
  RegisteredTemporary(const RegisteredTemporary&) = delete;
  RegisteredTemporary& operator=(const RegisteredTemporary&) = delete;

 private:
  TemporarySlot* slot_ = nullptr;
};

void remove_temporaries_and_die(int signal) {
  for (TemporarySlot& slot : temporary_slots) {
    int published = 2;
    if (slot.state.compare_exchange_strong(published, 3)) ::unlink(slot.path);
  }
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

// Creates the temporary, which must not exist (O_EXCL: not through a link someone left at its name):
// 0600 while it is written where it replaces a file (a 0600 file's new contents are never readable by
// others, not even while they are written), the umask's for a new one.
void create_temporary(const fs::path& temporary, const std::string& file, std::optional<fs::perms> permissions) {
  const int descriptor = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                                permissions ? 0600 : 0666);
  if (descriptor < 0) throw_write_failure(file + ": cannot create " + temporary.string() + ": " + std::strerror(errno), errno);
  ::close(descriptor);
}

// Forces the temporary's bytes to the disk before it is renamed over the destination: otherwise a
// crash soon after the rename can leave the destination's name on an empty or partial file (the
// rename reaches the journal before the data), losing the old contents and the new. Then gives it the
// replaced file's permission bits: given before the write, a read-only (0444) file's bits made the
// temporary unwritable to its owner, and the run failed after its work with "cannot create" the
// temporary it had just created.
void flush_to_disk(const fs::path& temporary, const std::string& file, std::optional<fs::perms> permissions) {
  const int descriptor = ::open(temporary.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (descriptor < 0) throw_write_failure(file + ": cannot reopen " + temporary.string() + ": " + std::strerror(errno), errno);
  int result;
  do result = ::fsync(descriptor);
  while (result != 0 && errno == EINTR);
  const int sync_error = errno;
  const bool moded = result != 0 || !permissions || ::fchmod(descriptor, static_cast<mode_t>(*permissions) & 07777) == 0;
  const int mode_error = errno;
  ::close(descriptor);
  if (result != 0) throw WriteError(file + ": write failed: " + std::strerror(sync_error));
  if (!moded) {
    throw InputError(file + ": cannot set the permissions of " + temporary.string() + ": " + std::strerror(mode_error));
  }
}

// Write beside the destination, flush it to the disk and rename: a reader never sees a half-written
// file, and a crash leaves the old file or the new one. The temporary
// name is short (".metile-PID-N.tmp", not the destination's name with a suffix), so that any name
// the destination may have fits NAME_MAX. A file that is replaced keeps its permission bits (the
// temporary was created with the umask's, so a 0600 file became 0644 and a 0755 one lost its x).
void replace_atomically(const fs::path& destination, const std::string& file, std::optional<fs::perms> permissions,
                        const std::function<void(std::ostream&)>& write) {
  static std::atomic<unsigned> count{0};
  const fs::path temporary =
      destination.parent_path() / (".metile-" + std::to_string(::getpid()) + "-" + std::to_string(count++) + ".tmp");
  create_temporary(temporary, file, permissions);
  const RegisteredTemporary registered(temporary);  // until it is renamed or removed
  try {
    write_stream(temporary, file, write);
    flush_to_disk(temporary, file, permissions);
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
  std::error_code error;
  fs::rename(temporary, destination, error);
  if (error) {
    std::error_code ignored;  // the rename's error is the one to report
    fs::remove(temporary, ignored);
    throw_write_failure(file + ": cannot rename " + temporary.string() + " into place: " + error.message(), error.value());
  }
}

// Where a dangling link leads (its target not found), followed link by link (each relative target read
// from its link's folder) to the first path that is not a link: the file the link names, which does not
// exist yet, so that it is created as any new file is, by a temporary renamed onto it (opened through the
// link and written in place, a failed write left a truncated file there). A loop is an InputError.
fs::path dangling_link_target(const fs::path& link, const std::string& file) {
  fs::path at = link;
  for (int follows = 0; follows <= 40; ++follows) {  // the kernel follows 40 (ELOOP past them)
    std::error_code error;
    if (!fs::is_symlink(fs::symlink_status(at, error))) return at;
    const fs::path target = fs::read_symlink(at, error);
    if (error) throw InputError(file + ": cannot read the link " + at.string() + ": " + error.message());
    at = target.is_absolute() ? target : at.parent_path() / target;
  }
  throw InputError(file + ": too many levels of symbolic links");
}

// How write_output_file writes `path`, decided once for it and for check_output_file_writable: through
// a descriptor this process holds; in place (a FIFO, a character device, a link whose target has no
// path); or by replacing the file at `destination` (the link's target for a link, a dangling link's
// included), keeping a replaced file's permission bits. A directory or another kind of file is an
// InputError.
struct OutputTarget {
  enum class Way { descriptor, in_place, replaced } way = Way::replaced;
  int descriptor = -1;
  fs::path destination;
  std::optional<fs::perms> permissions;
};

OutputTarget output_target(const fs::path& path) {
  const std::string file = path.string();
  if (const int descriptor = own_descriptor(path); descriptor >= 0) return {OutputTarget::Way::descriptor, descriptor, path, {}};
  std::error_code error;
  fs::path destination = path;
  if (fs::is_symlink(fs::symlink_status(path, error))) {
    destination = fs::canonical(path, error);
    if (error) {
      // A target that exists but has no path (a pipe behind /dev/stdout or /proc/PID/fd/N, a deleted
      // file) is written through the link; only a target not found is created; any other failure to
      // follow the link (a loop, a name too long, a folder not searchable) is refused here, before the
      // work, as a path that cannot be written.
      const fs::file_status followed = fs::status(path, error);
      if (followed.type() == fs::file_type::not_found) {
        destination = dangling_link_target(path, file);
        // A closed descriptor's name (/dev/fd/N) or a /proc entry is no file to create.
        if (own_descriptor(destination) >= 0 || destination.string().starts_with("/proc/")) {
          throw InputError(file + ": cannot write: its link leads to " + destination.string() + ", which is not open");
        }
      } else if (error) {
        if (error.value() == ELOOP) throw InputError(file + ": too many levels of symbolic links");
        throw InputError(file + ": cannot write: " + error.message());
      } else {
        return {OutputTarget::Way::in_place, -1, path, {}};
      }
    }
  }
  const fs::file_status status = fs::status(destination, error);
  switch (status.type()) {
    case fs::file_type::not_found: return {OutputTarget::Way::replaced, -1, destination, std::nullopt};
    case fs::file_type::regular: return {OutputTarget::Way::replaced, -1, destination, status.permissions()};
    case fs::file_type::fifo:
    case fs::file_type::character: return {OutputTarget::Way::in_place, -1, destination, {}};
    case fs::file_type::directory: throw InputError(file + ": is a directory");
    default:
      if (error) throw InputError(file + ": cannot write: " + error.message());
      throw InputError(file + ": not a regular file, FIFO or character device; refusing to replace it");
  }
}

}  // namespace

void remove_temporary_files_on_fatal_signals() {
  struct sigaction action {};
  action.sa_handler = remove_temporaries_and_die;
  sigemptyset(&action.sa_mask);
  for (const int signal : kStoppingSignals) {
    // A signal the process was started ignoring stays ignored (`nohup`, a shell's background job).
    struct sigaction current {};
    if (sigaction(signal, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) continue;
    sigaction(signal, &action, nullptr);
  }
  ::signal(SIGXFSZ, SIG_IGN);
}

void check_output_file_writable(const fs::path& path) {
  const std::string file = path.string();
  const OutputTarget target = output_target(path);
  switch (target.way) {
    case OutputTarget::Way::descriptor:
      if (::fcntl(target.descriptor, F_GETFD) < 0) throw InputError(file + ": cannot write: " + std::strerror(errno));
      return;
    case OutputTarget::Way::in_place: return;
    case OutputTarget::Way::replaced: break;
  }
  // A regular file is replaced by a temporary written beside it: its folder must take a new file.
  std::error_code error;
  fs::path folder = target.destination.parent_path();
  if (folder.empty()) folder = ".";
  const fs::file_status folder_status = fs::status(folder, error);
  if (folder_status.type() == fs::file_type::not_found) throw InputError(file + ": no folder " + folder.string());
  if (folder_status.type() != fs::file_type::directory) throw InputError(file + ": " + folder.string() + " is not a folder");
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    throw InputError(file + ": cannot create a file in " + folder.string() + ": " + std::strerror(errno));
  }
}

void throw_write_failure(const std::string& message, int error_number) {
  switch (error_number) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EIO:
      throw WriteError(message);
    default:
      throw InputError(message);
  }
}

void write_output_file(const fs::path& path, const std::function<void(std::ostream&)>& write) {
  const std::string file = path.string();
  const OutputTarget target = output_target(path);
  switch (target.way) {
    case OutputTarget::Way::descriptor: return write_descriptor(target.descriptor, file, write);
    case OutputTarget::Way::in_place: return write_stream(target.destination, file, write);
    case OutputTarget::Way::replaced: return replace_atomically(target.destination, file, target.permissions, write);
  }
}

}  // namespace metile
