"""Runs torchrun (python3 -m torch.distributed.run) from Debian's
python3-torch as a user would, with the two mends Debian's builds need:
- 1.13 on Python 3.11: Std.from_str returns None for "0" (IntFlag semantics
  changed in 3.11) and torchrun crashes before starting anything; the one
  function is replaced.
- 2.6 (Debian 13): built without libuv, yet TCPStore asks for libuv by
  default, and torchrun's rendezvous (static and c10d alike) passes no
  use_libuv and ignores USE_LIBUV, so its agent fails ("use_libuv was
  requested but PyTorch was build without libuv support"); its TCPStore is
  given use_libuv=False, as docs/guide.md tells users to do.
Then it hands over."""
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing import api


def _from_str(text):
    if text.isdigit():
        return api.Std(int(text))
    return {int(i): api.Std(int(v)) for i, v in (item.split(":") for item in text.split(","))}


api.Std.from_str = staticmethod(_from_str)

if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 4) and \
        os.environ.get("USE_LIBUV", "0") == "0":
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    def _classic_tcp_store(*args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        return TCPStore(*args, **kwargs)

    static_tcp_rendezvous.TCPStore = _classic_tcp_store
    c10d_rendezvous_backend.TCPStore = _classic_tcp_store

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
