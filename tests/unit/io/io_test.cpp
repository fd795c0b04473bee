// Tests of include/metile/io.h and src/io/json_input.h. Oracles: the bytes
// written beforehand, what is left on disk (file types, link targets), and
// hand-counted nesting depths.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include <fstream>
#include <limits>
#include <thread>

#include "json_input.h"
#include "metile/io.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::error_of;
using testing::write_error_of;
using testing::read_text;

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() /
                 ("metile_io_test_" + std::to_string(::getpid()) + "_" +
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(directory_);
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  std::filesystem::path file(const std::string& name, const std::string& text) const {
    const std::filesystem::path path = directory_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  std::filesystem::path directory_;
};

TEST_F(IoTest, ReadsUpToTheLimitAndRefusesOneByteMore) {
  const std::string text(100, 'x');
  EXPECT_EQ(read_input_file(file("a", text), 100, "test"), text);
  const std::filesystem::path longer = file("b", text + "y");
  EXPECT_EQ(error_of([&] { read_input_file(longer, 100, "test"); }),
            longer.string() + ": larger than the 100-byte limit for test files");
}

TEST_F(IoTest, SpecialFilesAreReadInChunksUpToTheLimit) {
  EXPECT_EQ(error_of([] { read_input_file("/dev/zero", 200000, "test"); }),
            "/dev/zero: larger than the 200000-byte limit for test files");
  EXPECT_EQ(read_input_file("/dev/null", 10, "test"), "");
}

TEST_F(IoTest, DirectoriesAndMissingFilesAreNamed) {
  EXPECT_EQ(error_of([&] { read_input_file(directory_, 10, "graph"); }),
            directory_.string() + ": is a directory, not a graph file");
  EXPECT_EQ(error_of([&] { read_input_file(directory_ / "none", 10, "graph"); }),
            (directory_ / "none").string() + ": cannot open the file: No such file or directory");
  EXPECT_EQ(error_of([&] { regular_file_size("/dev/zero", "safetensors"); }),
            "/dev/zero: not a regular file (a safetensors file is read by offset)");
  EXPECT_EQ(regular_file_size(file("c", "12345"), "safetensors"), 5u);
}

TEST_F(IoTest, RegularFilesAreReplacedAtomically) {
  const std::filesystem::path path = file("out", "old contents");
  write_output_file(path, [](std::ostream& stream) { stream << "new"; });
  EXPECT_EQ(read_text(path), "new");
  // A writer that fails leaves the old file and no temporary beside it.
  EXPECT_THROW(write_output_file(path, [](std::ostream& stream) {
                 stream << "half";
                 throw InputError("stop");
               }),
               InputError);
  EXPECT_EQ(read_text(path), "new");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 1);
}

// A replaced file keeps its permission bits: the temporary was created with the umask's (0644 here),
// so a private 0600 file became readable by everyone and a 0750 script lost its x bits.
TEST_F(IoTest, AReplacedFileKeepsItsPermissions) {
  for (const auto mode : {std::filesystem::perms(0600), std::filesystem::perms(0750), std::filesystem::perms(0444)}) {
    const std::filesystem::path path = file("kept", "old");
    std::filesystem::permissions(path, mode);
    write_output_file(path, [](std::ostream& stream) { stream << "new"; });
    EXPECT_EQ(read_text(path), "new");
    EXPECT_EQ(std::filesystem::status(path).permissions(), mode) << std::oct << static_cast<int>(mode);
    std::filesystem::remove(path);
  }
  // A read-only file replaced by its owner, who is not root (as root, in a child that becomes nobody in a
  // folder everyone may write): the temporary took the 0444 bits before its bytes were written, and the
  // write failed with "cannot create" the temporary it had just created.
  const std::filesystem::path read_only = file("read-only", "old");
  std::filesystem::permissions(directory_, std::filesystem::perms::all);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::geteuid() == 0 && (::chown(read_only.c_str(), 65534, 65534) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      ::_exit(96);
    }
    if (::chmod(read_only.c_str(), 0444) != 0) ::_exit(95);
    try {
      write_output_file(read_only, [](std::ostream& stream) { stream << "new"; });
    } catch (...) {
      ::_exit(97);  // never back into gtest in the child
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(read_text(read_only), "new");
  EXPECT_EQ(std::filesystem::status(read_only).permissions(), std::filesystem::perms(0444));
  // A new file gets the umask's, as any program's would.
  const mode_t umask_bits = ::umask(022);
  const std::filesystem::path fresh = directory_ / "fresh";
  write_output_file(fresh, [](std::ostream& stream) { stream << "new"; });
  ::umask(umask_bits);
  EXPECT_EQ(std::filesystem::status(fresh).permissions(), std::filesystem::perms(0644));
}

// A fatal signal while write_output_file writes (Ctrl-C, a kill, a closed terminal during `metile run
// --output`) left the half-written ".metile-PID-N.tmp" beside the destination. In a child that installs
// the CLI's handlers, the writer signals itself halfway: the child dies of the signal, as before, and
// neither the temporary nor a change to the destination is left.
TEST_F(IoTest, AFatalSignalMidWriteLeavesNoTemporary) {
  for (const int signal : kStoppingSignals) {  // Ctrl-\ (SIGQUIT) and `timeout -s ALRM` left it too
    const std::filesystem::path path = file("out", "old contents");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      try {
        remove_temporary_files_on_fatal_signals();
        write_output_file(path, [&](std::ostream& stream) {
          stream << std::string(1 << 20, 'x') << std::flush;  // on disk: the temporary holds a megabyte
          ::raise(signal);
          stream << "never";
        });
      } catch (...) {
        ::_exit(97);  // never back into gtest in the child
      }
      ::_exit(0);  // not reached
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == signal) << "signal " << signal << ", status " << status;
    EXPECT_EQ(read_text(path), "old contents");
    EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 1)
        << "signal " << signal << " left " << std::filesystem::directory_iterator(directory_)->path();
  }
}

// A signal the process was started ignoring (`nohup`, a background job's SIGINT) stays ignored: the
// handler replaced it, so `nohup metile run --output ...` died when its terminal closed.
TEST_F(IoTest, AnIgnoredSignalStaysIgnored) {
  const std::filesystem::path path = file("out", "old contents");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      ::signal(SIGHUP, SIG_IGN);
      remove_temporary_files_on_fatal_signals();
      write_output_file(path, [&](std::ostream& stream) {
        ::raise(SIGHUP);
        stream << "written";
      });
    } catch (...) {
      ::_exit(97);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(read_text(path), "written");
}

// A rename that fails (the empty path: the temporary is written in the working directory, then
// renamed onto "") names the rename's own error; the temporary's removal overwrote it with its
// own success, so the message ended "into place: Success". Nothing is left behind.
// The check `metile run --output` makes before the run: each path write_output_file would refuse or
// fail on before its first byte is refused here with the reason, and what it writes is let through;
// nothing is created by the check.
TEST_F(IoTest, AnOutputPathIsCheckedBeforeTheWork) {
  const std::filesystem::path missing_folder = directory_ / "none" / "out.safetensors";
  EXPECT_EQ(error_of([&] { check_output_file_writable(missing_folder); }),
            missing_folder.string() + ": no folder " + (directory_ / "none").string());
  EXPECT_EQ(error_of([&] { check_output_file_writable(directory_); }), directory_.string() + ": is a directory");
  const std::filesystem::path under_a_file = file("plain", "x") / "out";
  EXPECT_EQ(error_of([&] { check_output_file_writable(under_a_file); }),
            under_a_file.string() + ": " + (directory_ / "plain").string() + " is not a folder");
  if (::geteuid() != 0) {  // root writes a read-only folder anyway
    const std::filesystem::path locked = directory_ / "locked";
    std::filesystem::create_directory(locked);
    std::filesystem::permissions(locked, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
    EXPECT_EQ(error_of([&] { check_output_file_writable(locked / "out"); }),
              (locked / "out").string() + ": cannot create a file in " + locked.string() + ": Permission denied");
    std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  }
  EXPECT_EQ(error_of([&] { check_output_file_writable(directory_ / "new"); }), "(no InputError)");
  EXPECT_EQ(error_of([&] { check_output_file_writable(file("existing", "x")); }), "(no InputError)");
  EXPECT_EQ(error_of([] { check_output_file_writable("/dev/null"); }), "(no InputError)");
  EXPECT_EQ(error_of([] { check_output_file_writable("/dev/stdout"); }), "(no InputError)");
  EXPECT_FALSE(std::filesystem::exists(directory_ / "new"));
}

TEST_F(IoTest, AFailedRenameNamesItsError) {
  const std::filesystem::path previous = std::filesystem::current_path();
  std::filesystem::current_path(directory_);
  const std::string message = error_of([] { write_output_file("", [](std::ostream& stream) { stream << "x"; }); });
  std::filesystem::current_path(previous);
  EXPECT_TRUE(message.starts_with(": cannot rename .metile-")) << message;
  EXPECT_TRUE(message.ends_with(" into place: No such file or directory")) << message;
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 0);
}

// A name of 250 bytes is a valid file name: its temporary ("NAME.tmpPID" before) went past NAME_MAX
// (255), so the write failed with "File name too long".
TEST_F(IoTest, AnyValidNameCanBeReplaced) {
  const std::filesystem::path path = file(std::string(250, 'o'), "old");
  write_output_file(path, [](std::ostream& stream) { stream << "new"; });
  EXPECT_EQ(read_text(path), "new");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 1);
}

// /dev/fd/N names a descriptor this process holds: written through it, at its offset. Resolved, it
// named the file behind it, which was replaced: a file opened for appending (stdout redirected with
// `>>`) lost what it held, and the descriptor was left pointing at the unlinked old file.
TEST_F(IoTest, OwnDescriptorsAreWrittenAtTheirOffset) {
  const std::filesystem::path log = file("log", "keep me\n");
  const int descriptor = ::open(log.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(descriptor, 0);
  struct stat before {};
  ASSERT_EQ(::stat(log.c_str(), &before), 0);
  for (const std::string& name : {"/dev/fd/" + std::to_string(descriptor), "/proc/self/fd/" + std::to_string(descriptor)}) {
    write_output_file(name, [&](std::ostream& stream) { stream << "via " << name.substr(0, 6) << "\n"; });
  }
  ::close(descriptor);
  struct stat after {};
  ASSERT_EQ(::stat(log.c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);  // the same file, not a replacement
  EXPECT_EQ(read_text(log), "keep me\nvia /dev/f\nvia /proc/\n");
  // A descriptor that is not open is named, and nothing is created.
  EXPECT_EQ(error_of([] { write_output_file("/dev/fd/987654", [](std::ostream& stream) { stream << "x"; }); }),
            "/dev/fd/987654: cannot write: Bad file descriptor");
}

TEST_F(IoTest, SymlinksAreWrittenThroughAndKept) {
  std::filesystem::create_directories(directory_ / "elsewhere");
  const std::filesystem::path target = file("elsewhere/target", "old");
  const std::filesystem::path link = directory_ / "link";
  std::filesystem::create_symlink("elsewhere/target", link);
  write_output_file(link, [](std::ostream& stream) { stream << "through"; });
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(read_text(target), "through");
  // A dangling link creates its target.
  const std::filesystem::path dangling = directory_ / "dangling";
  std::filesystem::create_symlink("created", dangling);
  write_output_file(dangling, [](std::ostream& stream) { stream << "made"; });
  EXPECT_TRUE(std::filesystem::is_symlink(dangling));
  EXPECT_EQ(read_text(directory_ / "created"), "made");
  // A dangling link whose write fails leaves its target absent: it was opened through the link and
  // written in place, and a failed write left a truncated file there. Links to links are followed.
  const std::filesystem::path chain = directory_ / "chain";
  std::filesystem::create_symlink("elsewhere/next", chain);
  std::filesystem::create_symlink("../never", directory_ / "elsewhere" / "next");
  EXPECT_EQ(error_of([&] {
              write_output_file(chain, [](std::ostream& stream) {
                stream << std::string(1 << 16, 'x') << std::flush;
                throw InputError("the writer failed");
              });
            }),
            "the writer failed");
  EXPECT_FALSE(std::filesystem::exists(directory_ / "never"));
  for (const auto& entry : std::filesystem::recursive_directory_iterator(directory_)) {  // no temporary left
    EXPECT_FALSE(entry.path().filename().string().starts_with(".metile-")) << entry.path();
  }
  write_output_file(chain, [](std::ostream& stream) { stream << "at the end"; });
  EXPECT_EQ(read_text(directory_ / "never"), "at the end");
  EXPECT_TRUE(std::filesystem::is_symlink(chain));
  // A link to a descriptor's name whose file is no path (a pipe's /dev/fd/N) is still written through.
  int pipe_ends[2];
  ASSERT_EQ(::pipe(pipe_ends), 0);
  const std::filesystem::path to_pipe = directory_ / "to_pipe";
  std::filesystem::create_symlink("/dev/fd/" + std::to_string(pipe_ends[1]), to_pipe);
  write_output_file(to_pipe, [](std::ostream& stream) { stream << "piped"; });
  ::close(pipe_ends[1]);
  char received[16] = {};
  EXPECT_EQ(::read(pipe_ends[0], received, sizeof received), 5);
  ::close(pipe_ends[0]);
  EXPECT_EQ(std::string(received), "piped");
  // A link whose target cannot be looked at (a name past NAME_MAX) or that leads to a closed descriptor is
  // refused by the check made before the work: written in place, it failed only after the run.
  const std::filesystem::path too_long = directory_ / "too_long";
  std::filesystem::create_symlink(std::string(300, 'n'), too_long);
  EXPECT_EQ(error_of([&] { check_output_file_writable(too_long); }), too_long.string() + ": cannot write: File name too long");
  const std::filesystem::path to_closed = directory_ / "to_closed";
  std::filesystem::create_symlink("/dev/fd/987654", to_closed);
  EXPECT_EQ(error_of([&] { check_output_file_writable(to_closed); }),
            to_closed.string() + ": cannot write: its link leads to /dev/fd/987654, which is not open");
  // A loop of links is refused by name.
  std::filesystem::create_symlink("loop_b", directory_ / "loop_a");
  std::filesystem::create_symlink("loop_a", directory_ / "loop_b");
  EXPECT_EQ(error_of([&] { write_output_file(directory_ / "loop_a", [](std::ostream& stream) { stream << "x"; }); }),
            (directory_ / "loop_a").string() + ": too many levels of symbolic links");
}

// A write past `ulimit -f` (SIGXFSZ, whose default action kills the process) left the half-written
// temporary beside the destination. With the CLI's handlers the signal is ignored: the write fails
// with EFBIG, the error names it, the temporary is removed and the destination keeps its contents.
TEST_F(IoTest, AWritePastTheFileSizeLimitFailsCleanly) {
  const std::filesystem::path path = file("out", "old contents");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    remove_temporary_files_on_fatal_signals();
    const struct rlimit limit{8192, 8192};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(96);
    try {
      write_output_file(path, [](std::ostream& stream) { stream << std::string(1 << 20, 'x'); });
    } catch (const WriteError& error) {
      ::_exit(std::string(error.what()).ends_with("File too large") ? 0 : 98);
    } catch (...) {
      ::_exit(97);  // never back into gtest in the child
    }
    ::_exit(99);  // written whole past the limit: not possible
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(read_text(path), "old contents");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 1);
}

// A full disk can strike while a file is created or renamed as well as while it is written (no inodes
// left, a quota): those failures were InputErrors (exit 2, ValueError) whatever the errno. The system's
// refusals are WriteErrors wherever they come; a mistake in the path stays an InputError.
TEST(WriteFailures, TheSystemsRefusalsAreWriteErrorsWhereverTheyCome) {
  for (const int refused : {ENOSPC, EDQUOT, EFBIG, EIO}) {
    const std::string message = std::string("out: cannot create out.tmp: ") + std::strerror(refused);
    EXPECT_EQ(write_error_of([&] { throw_write_failure(message, refused); }), message);
  }
  for (const int mistaken : {EACCES, EROFS, ENAMETOOLONG, ENOENT, EEXIST}) {
    const std::string message = std::string("out: cannot create out.tmp: ") + std::strerror(mistaken);
    EXPECT_EQ(error_of([&] { throw_write_failure(message, mistaken); }), message);
  }
}

TEST_F(IoTest, FifosAndCharacterDevicesAreWrittenInPlace) {
  const std::filesystem::path fifo = directory_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string received;
  std::thread reader([&] { received = read_text(fifo); });
  write_output_file(fifo, [](std::ostream& stream) { stream << "piped"; });
  reader.join();
  EXPECT_EQ(received, "piped");
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));

  write_output_file("/dev/null", [](std::ostream& stream) { stream << "gone"; });
  EXPECT_TRUE(std::filesystem::is_character_file("/dev/null"));
  EXPECT_EQ(write_error_of([] { write_output_file("/dev/full", [](std::ostream& stream) { stream << std::string(1 << 16, 'x'); }); }),
            "/dev/full: write failed: No space left on device");
  EXPECT_EQ(error_of([&] { write_output_file(directory_, [](std::ostream&) {}); }), directory_.string() + ": is a directory");
}

TEST(JsonInputTest, DepthLimitCountsOnlyBracketsOutsideStrings) {
  const auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_NO_THROW(parse_json_input(nested(kMaximumJsonDepth), "j"));
  EXPECT_EQ(error_of([&] { parse_json_input(nested(kMaximumJsonDepth + 1), "j"); }),
            "j: invalid JSON: nested deeper than 64 levels at byte 64");
  EXPECT_EQ(error_of([&] { parse_json_input(nested(100000), "j"); }),
            "j: invalid JSON: nested deeper than 64 levels at byte 64");
  // Brackets and escaped quotes inside strings are text.
  const std::string text = "[\"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"]";
  EXPECT_EQ(parse_json_input(text, "j")[0].get<std::string>().size(), 2001u);
}

TEST(JsonInputTest, NumbersOutOfRangeAndSyntaxErrorsAreInputErrors) {
  EXPECT_EQ(error_of([] { parse_json_input("[1e400]", "j"); }), "j: invalid JSON: number overflow parsing '1e400'");
  // A number that is not 0 but whose double is (it was read as 0: a scale factor of 1e-400 multiplied by
  // 0 where 1e-46 is refused as "0 in f32"); 0 spelled any way, and the smallest subnormal, are numbers.
  for (const std::string number : {"1e-400", "-1E-400", "0.00001e-320", "2.4e-324"}) {
    EXPECT_EQ(error_of([&] { parse_json_input("{\"a\": [" + number + "]}", "j"); }),
              "j: invalid JSON: the number " + number + " is outside a double's range (0 or 4.9e-324 .. 1.8e308)");
  }
  // A long spelling is shortened in the message.
  EXPECT_EQ(error_of([] { parse_json_input("[0." + std::string(400, '0') + "1]", "j"); }),
            "j: invalid JSON: the number 0." + std::string(35, '0') + "... is outside a double's range (0 or "
            "4.9e-324 .. 1.8e308)");
  for (const std::string number : {"0", "-0.0", "0e-999", "0.000e5", "4.9e-324", "1e-310"}) {
    EXPECT_EQ(error_of([&] { parse_json_input("[" + number + "]", "j"); }), "(no InputError)") << number;
  }
  EXPECT_EQ(parse_json_input("[4.9e-324]", "j")[0].get<double>(), std::numeric_limits<double>::denorm_min());
  EXPECT_EQ(error_of([] { parse_json_input("{", "j"); }).substr(0, 17), "j: invalid JSON: ");
  EXPECT_EQ(json_excerpt(nlohmann::json(std::string(100, 'a'))), "\"" + std::string(56, 'a') + "...");
}

}  // namespace
}  // namespace metile
