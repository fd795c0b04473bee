// metile io module: the one way metile reads an input file and writes an output
// file, with the limits every hostile input meets (README, "Input limits").
// Reading: a directory, a missing file or a file over its size limit is an
// InputError naming the file; special files (FIFOs, /dev/stdin, /dev/zero) are
// read in chunks up to the same limit, never grown without bound.
// Writing: a regular file (or none) is replaced atomically (temporary file beside
// it, then rename); a symlink is written through (its target is replaced, the
// link stays); a FIFO or character device is written in place, never replaced;
// /dev/stdout, /dev/stderr, /dev/fd/N and /proc/self/fd/N are written through
// the descriptor this process holds, at its offset, whatever file it is.
#pragma once

#include <array>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <ostream>
#include <string>
#include <string_view>

#include "metile/error.h"

namespace metile {

// Size limits of the files metile reads whole (README, "Input limits").
inline constexpr std::uint64_t kMaximumGraphFileBytes = std::uint64_t{256} << 20;
inline constexpr std::uint64_t kMaximumTargetFileBytes = std::uint64_t{1} << 20;
inline constexpr std::uint64_t kMaximumDimacsFileBytes = std::uint64_t{256} << 20;
inline constexpr std::uint64_t kMaximumSafetensorsHeaderBytes = std::uint64_t{100} << 20;
// A checkpoint's config.json and model.safetensors.index.json (a 405B model's index is ~100 KB).
inline constexpr std::uint64_t kMaximumCheckpointJsonBytes = std::uint64_t{16} << 20;
// Deepest nesting of arrays and objects in any JSON metile reads (a graph needs 4).
inline constexpr int kMaximumJsonDepth = 64;

// The whole file as bytes. Throws InputError "PATH: is a directory", "PATH: cannot
// open the file: REASON", "PATH: larger than the LIMIT-byte limit for WHAT".
std::string read_input_file(const std::filesystem::path& path, std::uint64_t maximum_bytes, std::string_view what);

// The size of a regular file that is read in parts (safetensors); InputError for a
// directory, a missing file or a special file.
std::uint64_t regular_file_size(const std::filesystem::path& path, std::string_view what);

// The status of a path a user named, or one inside a directory they named (a checkpoint's files):
// std::filesystem::status, or symlink_status where follow_symlinks is false. A path the system
// cannot look at (a loop of symbolic links, a name too long, a directory it may not search) is an
// InputError "PATH: REASON" (the throwing std::filesystem calls gave a filesystem_error, which reads
// as an internal failure); a missing one is file_type::not_found.
std::filesystem::file_status input_path_status(const std::filesystem::path& path, bool follow_symlinks = true);

// Writes a file by calling write(stream) once, as described above; nothing is
// left half-written in place of a regular file. write() must not throw after it
// has started writing to a special file (a FIFO cannot be rolled back).
void write_output_file(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write);

// A failure to create, reopen or rename a file metile writes: a WriteError (error.h) when the system
// refused the bytes (errno ENOSPC, EDQUOT, EFBIG, EIO: a full disk, inodes or quota, the file size
// limit, a failing device), as a failed write is; an InputError otherwise (the path the user gave: no
// permission, a read-only file system, a name too long). `message` ends with the errno's text.
[[noreturn]] void throw_write_failure(const std::string& message, int error_number);

// Whether write_output_file(path, ...) can start, checked before the work whose result it writes (a
// graph run that takes minutes): the path is not a directory or another kind of file it refuses, and
// the folder that takes the temporary exists and may be written. An InputError saying why otherwise.
// The write itself can still fail (a full disk); this catches the mistakes in the path.
void check_output_file_writable(const std::filesystem::path& path);

// The signals that end a process by default and that a person or a job controller sends to stop a
// command: Ctrl-C and Ctrl-\, kill, a closed terminal, `timeout -s ALRM`, USR1/USR2, a CPU-time limit.
// What the CLI writes is cleaned up after each (remove_temporary_files_on_fatal_signals below,
// synth-model's interrupt flag); with the first three alone, Ctrl-\ left a half-written file behind.
inline constexpr std::array<int, 9> kStoppingSignals = {SIGINT, SIGTERM, SIGHUP,    SIGQUIT, SIGALRM,
                                                        SIGUSR1, SIGUSR2, SIGVTALRM, SIGXCPU};

// For programs (the CLI calls it first): kStoppingSignals remove the temporary file a
// write_output_file is writing before the process dies of the signal as it would have. Without it a
// Ctrl-C during `metile run --output` left ".metile-PID-N.tmp", a half-written copy, beside the
// destination. A signal the process was started ignoring (`nohup`) stays ignored; a handler a command
// installs later (synth-model's interrupt flag) takes precedence while it lives. SIGXFSZ (a write past
// `ulimit -f`) is ignored, so that the write fails with EFBIG and its error path removes the temporary
// and says why; by default the signal killed the process and left the temporary.
void remove_temporary_files_on_fatal_signals();

// The machine's physical memory in bytes (the largest uint64 when it cannot be told),
// for limits that depend on the machine: DIMACS counts, `metile run`'s tensors.
std::uint64_t physical_memory_bytes();

}  // namespace metile
