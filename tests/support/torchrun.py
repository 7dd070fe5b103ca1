"""Runs torchrun (python3 -m torch.distributed.run) from Debian's
python3-torch 1.13 on Python 3.11, where Std.from_str returns None for "0"
(IntFlag semantics changed in 3.11) and torchrun crashes before starting
anything. This wrapper mends that one function, then hands over."""
import sys

from torch.distributed.elastic.multiprocessing import api


def _from_str(text):
    if text.isdigit():
        return api.Std(int(text))
    return {int(i): api.Std(int(v)) for i, v in (item.split(":") for item in text.split(","))}


api.Std.from_str = staticmethod(_from_str)

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
