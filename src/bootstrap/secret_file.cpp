// SPDX-License-Identifier: Apache-2.0
#include "bootstrap/secret_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <fmt/format.h>

#include "bootstrap/session.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail {

// The file is opened without following a symbolic link, and its owner and mode are checked on
// the open file, so no one can swap it between the check and the read.
std::vector<std::uint8_t> read_secret_file(const std::string& path, const char* verb, std::size_t max) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    throw Error(verb, err, path,
                err == ELOOP ? "it is a symbolic link: give the file itself (a link could be "
                               "pointed elsewhere by whoever can change it)"
                             : "");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(verb, errno, path);
  if (!S_ISREG(st.st_mode)) throw Error(verb, EINVAL, fmt::format("{} is not a regular file", path));
  if (st.st_uid != ::geteuid()) {
    throw Error(verb, EPERM,
                fmt::format("{} belongs to uid {}, not to this process's uid {}", path, st.st_uid, ::geteuid()),
                "a secret's file must belong to the user that reads it (whoever owns it can change it)");
  }
  if ((st.st_mode & 077) != 0) {
    throw Error(verb, EPERM,
                fmt::format("{} can be read or written by other users (mode {:o})", path, st.st_mode & 0777),
                fmt::format("a key others can read is no secret: chmod 600 {}", path));
  }
  if (st.st_size > static_cast<off_t>(max)) {
    throw Error(verb, EFBIG, fmt::format("{}: {} bytes; the file holds at most {}", path, st.st_size, max),
                "is it the right file? `rdmakit keygen FILE` writes a key, `rdmakit keygen --identity FILE` an identity");
  }
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      wipe(bytes);
      throw Error(verb, n < 0 ? errno : EIO, path);
    }
    got += static_cast<std::size_t>(n);
  }
  return bytes;
}

void write_new_file(const std::string& path, std::span<const std::uint8_t> bytes, unsigned mode, const char* verb) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) {
    const int err = errno;
    throw Error(verb, err, path, err == EEXIST ? "it exists already; a key is not overwritten (remove it first)" : "");
  }
  // fchmod: the umask must not widen or narrow what a secret's (or a public key's) file needs.
  const bool ok = ::fchmod(fd, mode) == 0 &&
                  ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    throw Error(verb, err, path);
  }
}

}  // namespace rdmakit::detail
