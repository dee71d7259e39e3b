// Output files (spec/output_file.h): the check before a run changes nothing and leaves no
// temporary; a write replaces the file whole and keeps its permission bits; a write that fails
// (a folder, /dev/full, a read-only file) leaves the old file as it was and no temporary; a
// symbolic link keeps pointing at its target, which gets the new text.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>

#include "spec/errors.h"
#include "spec/output_file.h"

namespace flatpeak {
namespace {

namespace fs = std::filesystem;

class OutputFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("flatpeak_output_file_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, ignored);
    fs::remove_all(dir_, ignored);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  static std::string read(const std::string& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static void write(const std::string& p, const std::string& text) { std::ofstream(p) << text; }
  size_t entries() const {
    return static_cast<size_t>(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()));
  }
  static std::string message_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const InputError& e) {
      return e.diagnostics().front().to_string();
    }
    return "";
  }
  fs::path dir_;
};

TEST_F(OutputFile, CheckLeavesAnExistingFileAndNoTemporary) {
  write(path("trace.json"), "old trace");
  check_output_file(path("trace.json"), "the trace");
  EXPECT_EQ(read(path("trace.json")), "old trace");
  EXPECT_EQ(entries(), 1u);
  check_output_file(path("new.json"), "the trace");
  EXPECT_FALSE(fs::exists(path("new.json")));
  EXPECT_EQ(entries(), 1u);
}

TEST_F(OutputFile, WriteReplacesTheFileAndKeepsItsMode) {
  write(path("trace.json"), "an old trace, longer than the new one");
  ASSERT_EQ(::chmod(path("trace.json").c_str(), 0640), 0);
  write_output_file(path("trace.json"), "new", "the trace");
  EXPECT_EQ(read(path("trace.json")), "new");
  struct stat st {};
  ASSERT_EQ(::stat(path("trace.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_EQ(entries(), 1u);
  write_output_file(path("fresh.json"), "fresh", "the trace");
  EXPECT_EQ(read(path("fresh.json")), "fresh");
  EXPECT_EQ(entries(), 2u);
}

TEST_F(OutputFile, ASymbolicLinkKeepsPointingAtItsTarget) {
  write(path("target.json"), "old");
  fs::create_symlink(path("target.json"), path("link.json"));
  write_output_file(path("link.json"), "new", "the trace");
  EXPECT_TRUE(fs::is_symlink(path("link.json")));
  EXPECT_EQ(read(path("target.json")), "new");
  EXPECT_EQ(entries(), 2u);
}

TEST_F(OutputFile, FailuresNameThePathAndLeaveTheOldFile) {
  fs::create_directories(path("folder"));
  EXPECT_EQ(message_of([&] { check_output_file(path("folder"), "the trace"); }),
            path("folder") + ": cannot write the trace (it is a folder)");
  EXPECT_EQ(message_of([&] { write_output_file(path("folder"), "x", "the trace"); }),
            path("folder") + ": cannot write the trace (it is a folder)");
  EXPECT_EQ(message_of([] { check_output_file("/nonexistent/dir/trace.json", "the trace"); }),
            "/nonexistent/dir/trace.json: cannot write the trace (No such file or directory)");
  // /dev/full takes the open and fails the write: the check passes, the write names the reason.
  EXPECT_EQ(message_of([] { check_output_file("/dev/full", "the trace"); }), "");
  EXPECT_EQ(message_of([] { write_output_file("/dev/full", "x", "the trace"); }),
            "/dev/full: cannot write the trace (No space left on device)");
  write_output_file("/dev/null", "x", "the trace");  // a special file is written, not replaced
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  if (::geteuid() != 0) {  // root writes anything: permissions cannot fail there
    write(path("kept.json"), "old trace");
    ASSERT_EQ(::chmod(path("kept.json").c_str(), 0444), 0);
    EXPECT_EQ(message_of([&] { check_output_file(path("kept.json"), "the trace"); }),
              path("kept.json") + ": cannot write the trace (Permission denied)");
    EXPECT_EQ(message_of([&] { write_output_file(path("kept.json"), "new", "the trace"); }),
              path("kept.json") + ": cannot write the trace (Permission denied)");
    EXPECT_EQ(read(path("kept.json")), "old trace");
  }
  EXPECT_EQ(entries(), geteuid() != 0 ? 2u : 1u);  // no temporary left behind
}

// A write that fails after the check (here the temporary's name is taken by a folder, which
// fails even for root) leaves the old file whole.
TEST_F(OutputFile, AFailedWriteLeavesTheOldFileWhole) {
  write(path("trace.json"), "old trace");
  fs::create_directories(path("trace.json.tmp-" + std::to_string(::getpid())));
  EXPECT_EQ(message_of([&] { write_output_file(path("trace.json"), "new", "the trace"); }),
            path("trace.json") + ": cannot write the trace (Is a directory)");
  EXPECT_EQ(read(path("trace.json")), "old trace");
}

}  // namespace
}  // namespace flatpeak
