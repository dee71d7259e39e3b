#include "output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "errors.h"

namespace flatpeak {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, const std::string& reason) {
  throw InputError(Diagnostic{path, "", "cannot write " + what + " (" + reason + ")", ""});
}

// The file a path names: a symbolic link resolved (so that rename replaces its target, not the
// link); the path itself when it does not exist yet.
std::string resolved(const std::string& path) {
  char buffer[PATH_MAX];
  if (::realpath(path.c_str(), buffer) != nullptr) return buffer;
  return path;
}

std::string temporary_of(const std::string& target) {
  return target + ".tmp-" + std::to_string(::getpid());
}

// Writes all of text to fd; false with errno set on a failure (a full device, a closed pipe).
bool write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

void check_output_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (path.empty()) fail(path, what, "the path is empty");
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) fail(path, what, "it is a folder");
    if (::access(path.c_str(), W_OK) != 0) fail(path, what, std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return;  // written directly
  }
  // A regular or new file is replaced through a temporary beside it: try one.
  const std::string temporary = temporary_of(resolved(path));
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail(path, what, std::strerror(errno));
  ::close(fd);
  ::unlink(temporary.c_str());
}

void write_output_file(const std::string& path, const std::string& text, const std::string& what) {
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (exists && S_ISDIR(st.st_mode)) fail(path, what, "it is a folder");
  if (exists && !S_ISREG(st.st_mode)) {
    // A device or a pipe: no rename onto it; a full device fails at the write or the close.
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail(path, what, std::strerror(errno));
    int failure = write_all(fd, text) ? 0 : errno;
    if (::close(fd) != 0 && failure == 0) failure = errno;
    if (failure != 0) fail(path, what, std::strerror(failure));
    return;
  }
  if (exists && ::access(path.c_str(), W_OK) != 0) fail(path, what, std::strerror(errno));
  const std::string target = resolved(path);
  const std::string temporary = temporary_of(target);
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) fail(path, what, std::strerror(errno));
  // Each step runs only when the previous ones succeeded; errno then names the failing one.
  const bool written = write_all(fd, text) && (!exists || ::fchmod(fd, st.st_mode & 07777) == 0);
  int failure = written ? 0 : errno;
  if (::close(fd) != 0 && failure == 0) failure = errno;  // a full disk may fail only here
  if (failure == 0 && ::rename(temporary.c_str(), target.c_str()) != 0) failure = errno;
  if (failure != 0) {
    ::unlink(temporary.c_str());
    fail(path, what, std::strerror(failure));
  }
}

}  // namespace flatpeak
