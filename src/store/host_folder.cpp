#include "store/host_folder.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace lockstep::store {

namespace fs = std::filesystem;

std::string private_base(std::string& error) {
  const char* tmp = std::getenv("TMPDIR");
  fs::path base = fs::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") /
      ("lockstep-" + std::to_string(::getuid()));
  if (::mkdir(base.c_str(), 0700) != 0 && errno != EEXIST) {
    error = "cannot create " + base.string() + " for the job's store: " + std::strerror(errno) +
        ". Set TMPDIR to a writable folder (the same for every rank).";
    return "";
  }
  struct stat info {};
  bool private_folder = ::lstat(base.c_str(), &info) == 0 && S_ISDIR(info.st_mode) &&
      info.st_uid == ::getuid() && (info.st_mode & 077) == 0;
  if (!private_folder) {
    error = base.string() + " must be a folder that only this user can enter (owner uid " +
        std::to_string(::getuid()) + ", mode 0700), since it holds the job's store; remove "
        "it, or set TMPDIR to another folder (the same for every rank).";
    return "";
  }
  return base.string();
}

std::string job_folder(const std::string& base, int port) {
  return (fs::path(base) / ("port-" + std::to_string(port))).string();
}

std::string socket_path(const std::string& folder) {
  return (fs::path(folder) / "store").string();
}

std::string create_job_folder(const std::string& folder, const std::string& owner) {
  std::error_code ignored;
  fs::remove_all(folder, ignored);
  fs::path draft = folder + ".draft";
  fs::remove_all(draft, ignored);
  if (!fs::create_directory(draft, ignored)) {
    return "cannot create " + draft.string();
  }
  std::ofstream written(draft / "owner");
  written << owner << "\n";
  written.close();
  if (!written) { // a folder without its owner would be taken for abandoned
    fs::remove_all(draft, ignored);
    return "cannot write the owner of " + draft.string();
  }
  std::error_code renamed;
  fs::rename(draft, folder, renamed);
  return renamed ? "cannot create " + folder + ": " + renamed.message() : "";
}

bool is_job_folder_name(const std::string& name) {
  const std::string prefix = "port-";
  return name.size() > prefix.size() && name.rfind(prefix, 0) == 0 &&
      std::all_of(name.begin() + prefix.size(), name.end(),
                  [](char c) { return c >= '0' && c <= '9'; });
}

std::string folder_owner(const std::string& folder) {
  std::ifstream in(fs::path(folder) / "owner");
  std::string line;
  std::getline(in, line);
  return line;
}

void remove_folder(const std::string& folder) {
  std::error_code ignored;
  fs::remove_all(folder, ignored);
}

} // namespace lockstep::store
