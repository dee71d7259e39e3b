// Output files written so that a failed write never destroys the file already there.
//   check_output_file("trace.json", "the trace");        // before a long run; changes nothing
//   write_output_file("trace.json", text, "the trace");  // InputError "trace.json: cannot write the trace
//   (...)"
#pragma once

#include <string>

namespace flatpeak {

// Checks that write_output_file can write `path` without creating or changing it: an existing
// file (regular or special: /dev/null, a pipe) must be writable (a pipe is not opened: that
// would wait for a reader), a folder is refused, and for a regular or new file the folder must
// take a new file (a temporary is created there and removed). Throws InputError naming the path,
// `what` ("the trace") and the reason.
void check_output_file(const std::string& path, const std::string& what);

// Writes `text` to `path`. A regular file or a new one is written to PATH.tmp-<pid> in its
// folder (through a symbolic link: in the target's folder) and renamed onto it once written
// and closed, keeping an existing file's permission bits; on failure the temporary is removed
// and the old file stays whole. A special file (/dev/full, a pipe) is written directly.
// Throws InputError naming the path, `what` and the reason.
void write_output_file(const std::string& path, const std::string& text, const std::string& what);

}  // namespace flatpeak
