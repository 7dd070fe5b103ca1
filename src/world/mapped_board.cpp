// The ledger's records in a file mapped by every rank of a one-host job:
// per rank, the last collective reached, whether it closed, and a ring of
// the last operations it posted (what DETAIL compares).

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include <lockstep/error.h>

#include "world/ledger_board.h"

namespace lockstep::detail {
namespace {

// A rank posts again only after every rank read its last post (DETAIL
// waits for all before each collective), so two entries would do; more
// keep recent history for attendance.
constexpr uint64_t kRing = 64;

struct alignas(64) Entry {
  std::atomic<uint64_t> seq;
  uint32_t length;
  char text[1012];
};

struct alignas(64) Slot {
  std::atomic<uint64_t> arrived;
  // Collectives completed + 1, times 2, plus 1 when closed by an error;
  // 0 while open.
  std::atomic<uint64_t> closed;
  Entry ring[kRing];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the mapped ledger needs lock-free 64-bit atomics");

size_t board_bytes(int size) {
  return sizeof(Slot) * static_cast<size_t>(size);
}

class MappedBoard : public LedgerBoard {
 public:
  MappedBoard(Slot* slots, size_t bytes, int rank, int size)
      : slots_(slots), bytes_(bytes), rank_(rank), size_(size) {}
  ~MappedBoard() override {
    ::munmap(slots_, bytes_);
  }

  void post(uint64_t seq, const std::string& what) override {
    auto& entry = slots_[rank_].ring[seq % kRing];
    // The entry is invalid while it is rewritten.
    entry.seq.store(0, std::memory_order_release);
    entry.length = static_cast<uint32_t>(std::min(what.size(), sizeof(entry.text)));
    std::memcpy(entry.text, what.data(), entry.length);
    entry.seq.store(seq, std::memory_order_release);
    slots_[rank_].arrived.store(seq, std::memory_order_release);
  }

  bool reached(int rank, uint64_t seq) override {
    return slots_[rank].arrived.load(std::memory_order_acquire) >= seq;
  }

  std::optional<std::string> posted(int rank, uint64_t seq) override {
    auto& entry = slots_[rank].ring[seq % kRing];
    if (entry.seq.load(std::memory_order_acquire) != seq) {
      return std::nullopt;
    }
    std::string text(entry.text, std::min<size_t>(entry.length, sizeof(entry.text)));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (entry.seq.load(std::memory_order_relaxed) != seq) {
      return std::nullopt;
    }
    return text;
  }

  // Every rank of a one-host job sees every other's process: no cause
  // needs to travel.
  void close(uint64_t count, bool failed, const std::string& /*cause*/) override {
    uint64_t open = 0;
    slots_[rank_].closed.compare_exchange_strong(open, (count + 1) * 2 + (failed ? 1 : 0));
  }

  std::map<int, Closed> closed() override {
    std::map<int, Closed> ranks;
    for (int rank = 0; rank < size_; ++rank) {
      uint64_t value = slots_[rank].closed.load(std::memory_order_acquire);
      if (value > 0) {
        ranks[rank] = {value / 2 - 1, value % 2 == 1, ""};
      }
    }
    return ranks;
  }

 private:
  Slot* slots_;
  size_t bytes_;
  int rank_;
  int size_;
};

} // namespace

void create_mapped_board(const std::string& path, int size) {
  // Every rank of the world creates it or finds it (they race, and each
  // sets the same size, which keeps what another wrote).
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  bool sized = fd >= 0 && ::ftruncate(fd, static_cast<off_t>(board_bytes(size))) == 0;
  int error = errno;
  if (fd >= 0) {
    ::close(fd);
  }
  LOCKSTEP_ENFORCE(sized, RendezvousError, "cannot create the job's ledger at ", path,
                   ": ", std::strerror(error), ".");
}

std::unique_ptr<LedgerBoard> open_mapped_board(const std::string& path, int rank, int size) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  void* mapped = MAP_FAILED;
  if (fd >= 0) {
    mapped = ::mmap(nullptr, board_bytes(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  int error = errno;
  if (fd >= 0) {
    ::close(fd);
  }
  LOCKSTEP_ENFORCE(mapped != MAP_FAILED, RendezvousError, "rank ", rank,
                   " cannot map the job's ledger at ", path, ": ", std::strerror(error), ".");
  return std::make_unique<MappedBoard>(static_cast<Slot*>(mapped), board_bytes(size), rank,
                                       size);
}

} // namespace lockstep::detail
