#pragma once

// Every rank's tensor delivered to every other rank by point-to-point
// messages, all posted at once, in pieces. Gloo runs each collective as a
// work queued for one of its threads, and a rank busy with backward on its
// core starts each a few ms late: a gather in small pieces paid that per
// piece, a gather in large pieces could not keep the link busy. Posted
// sends and receives need no such thread: the connection carries them back
// to back as soon as they are posted.

#include <functional>
#include <memory>
#include <vector>

#include "compat/c10d.h"
#include "transport/transport.h"

namespace lockstep::detail {

/// Called with the elements [first, first + length) of one piece once it
/// has arrived from every rank and this rank's has left: `mine` may then be
/// overwritten there.
using PieceArrived = std::function<void(int64_t first, int64_t length)>;

/// Sends `mine` (flat) to every other rank of `group` and receives rank r's
/// into `parts[r]` (flat, as long; `parts[rank]` is not written), calling
/// `arrived` for each piece, in order, on a thread of the exchange's own,
/// while later pieces are still crossing. `exchange` numbers the exchanges
/// of the group (every rank the same number for the same exchange): it
/// tells their messages apart.
std::unique_ptr<TransportWork> start_posted_exchange(CollectiveBackend& group,
                                                     const at::Tensor& mine,
                                                     const std::vector<at::Tensor>& parts,
                                                     uint64_t exchange,
                                                     PieceArrived arrived);

} // namespace lockstep::detail
