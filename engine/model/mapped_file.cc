#include "engine/model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace coalesce::engine {

absl::StatusOr<std::shared_ptr<const void>> MapFile(const std::string& path, size_t* size) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string message = absl::StrCat("cannot open ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::InternalError(message);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  *size = static_cast<size_t>(st.st_size);
  if (*size == 0) {
    close(fd);
    return std::shared_ptr<const void>();
  }
  void* data = mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps its own reference to the file
  if (data == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot mmap ", path, ": ", std::strerror(err)));
  }
  const size_t length = *size;
  return std::shared_ptr<const void>(
      data, [length](const void* p) { munmap(const_cast<void*>(p), length); });
}

}  // namespace coalesce::engine
