// Writing a file whole or not at all: the bytes go to a new temporary file
// beside `path` (mkstemp: O_EXCL, so nothing that already sits there, a
// symlink included, is followed), are synced, get an ordinary new file's
// mode (0666 less the umask, not mkstemp's 0600) and are renamed over
// `path`. Something at `path` that is not a regular file (a directory, a
// FIFO, a device node, a socket) is an error and is left as it is. On any
// failure the temporary file is removed, `path` is as it
// was, and a kvq::Error names `arg` and the cause.
#pragma once

#include <cstdint>
#include <initializer_list>
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

// The first min(n, size) bytes of a regular file and, in *size, its size;
// errors as read_file_whole's.
std::vector<uint8_t> read_file_head(const std::string& path, size_t n, uint64_t* size, const char* arg = "path");

// An output path (option `arg`) checked before any work: not a directory,
// not one of the run's inputs (same device and inode, so a link to an input
// counts), in a directory that exists and takes a new file (one is created
// there and removed). An empty path passes. kvq::Error otherwise.
void check_output_path(const char* arg, const std::string& path, std::initializer_list<std::string> inputs);

}  // namespace kvq
