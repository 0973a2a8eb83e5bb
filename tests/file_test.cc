// Whole-or-nothing files (kvq/file.h): writes that leave no partial file and
// no temporary, reads bounded by their size before any allocation, and the
// output-path check that keeps an output off the run's inputs.
#include "kvq/file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace kvq {
namespace {

using test::ErrorOf;
namespace fs = std::filesystem;

struct TempDir {
  fs::path p = fs::temp_directory_path() / ("kvq_file_test_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(p); }
  ~TempDir() { fs::remove_all(p); }
  std::string operator/(const std::string& name) const { return (p / name).string(); }
  size_t entries() const { return static_cast<size_t>(std::distance(fs::directory_iterator(p), fs::directory_iterator())); }
};

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(File, WritesWholeReplaceRegularFilesAndLeaveNoTemporary) {
  TempDir d;
  const std::string f = d / "a.bin";
  write_file_whole(f, Bytes("first"), "out");
  write_file_whole(f, Bytes("second, longer"), "out");
  EXPECT_EQ(read_file_whole(f, 1 << 10, "in"), Bytes("second, longer"));
  EXPECT_EQ(d.entries(), 1u);
  struct stat st {};
  ASSERT_EQ(::stat(f.c_str(), &st), 0);
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(st.st_mode & 0777, 0666u & ~mask);  // an ordinary new file's mode, not mkstemp's 0600
  EXPECT_NE(ErrorOf([&] { write_file_whole(d / "no" + "/x", Bytes("x"), "--json"); }).find("--json"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { write_file_whole(d.p.string(), Bytes("x"), "out"); }).find("directory"), std::string::npos);
  EXPECT_EQ(d.entries(), 1u);
}

TEST(File, ReadsAreBoundedBeforeAnythingIsAllocated) {
  TempDir d;
  const std::string f = d / "b.bin";
  write_file_whole(f, Bytes("0123456789"));
  EXPECT_EQ(read_file_whole(f, 10).size(), 10u);
  EXPECT_NE(ErrorOf([&] { read_file_whole(f, 9, "--tokens"); }).find("--tokens '" + f + "'"), std::string::npos);
  uint64_t size = 0;
  EXPECT_EQ(read_file_head(f, 4, &size), Bytes("0123"));
  EXPECT_EQ(size, 10u);
  EXPECT_EQ(read_file_head(f, 64, &size), Bytes("0123456789"));
  EXPECT_NE(ErrorOf([&] { read_file_whole(d / "none", 10); }).find("cannot open"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { read_file_whole(d.p.string(), 10); }).find("regular file"), std::string::npos);
  EXPECT_NE(ErrorOf([] { read_file_whole("/dev/zero", 10); }).find("regular file"), std::string::npos);
}

TEST(File, AnOutputPathIsNeitherAnInputNorADirectory) {
  TempDir d;
  const std::string in = d / "model.bin", out = d / "out.json";
  write_file_whole(in, Bytes("weights"));
  check_output_path("--json", "", {in});   // no output: nothing to check
  check_output_path("--json", out, {in});  // a new file in a writable directory
  EXPECT_NE(ErrorOf([&] { check_output_path("--json", in, {in}); }).find("refusing to overwrite"), std::string::npos);
  // A link to an input is that input.
  const std::string hard = d / "hard.bin", soft = d / "soft.bin";
  ASSERT_EQ(::link(in.c_str(), hard.c_str()), 0);
  ASSERT_EQ(::symlink(in.c_str(), soft.c_str()), 0);
  for (const std::string& p : {hard, soft}) {
    EXPECT_NE(ErrorOf([&] { check_output_path("--save-cache", p, {in}); }).find("--save-cache: '" + p + "' is this run's input"),
              std::string::npos)
        << p;
  }
  EXPECT_NE(ErrorOf([&] { check_output_path("--json", d.p.string(), {in}); }).find("is a directory"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { check_output_path("--json", d / "none/out.json", {in}); }).find("does not exist"),
            std::string::npos);
  EXPECT_EQ(read_file_whole(in, 64), Bytes("weights"));
  EXPECT_EQ(d.entries(), 3u);  // the input and its two links: no probe file left
}

}  // namespace
}  // namespace kvq
