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

namespace kvq {

void write_file_whole(const std::string& path, std::span<const uint8_t> bytes, const char* arg = "path");

}  // namespace kvq
