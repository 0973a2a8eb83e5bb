// Writing a file whole or not at all: the bytes go to a new temporary file
// beside `path` (mkstemp: O_EXCL, so nothing that already sits there, a
// symlink included, is followed), are synced, get an ordinary new file's
// mode (0666 less the umask, not mkstemp's 0600) and are renamed over
// `path`. On any failure the temporary file is removed, `path` is as it
// was, and a kvq::Error names `arg` and the cause.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvq {

void write_file_whole(const std::string& path, std::span<const uint8_t> bytes, const char* arg = "path");

// The whole of a regular file of at most max_bytes (checked by stat before
// anything is allocated); a kvq::Error "<arg> '<path>': ..." when it cannot
// be opened, is not a regular file (a FIFO, /dev/zero, a directory) or is
// larger. A file that shrinks while it is read is returned as read.
std::vector<uint8_t> read_file_whole(const std::string& path, uint64_t max_bytes, const char* arg = "path");

}  // namespace kvq
