"""Messages between the engine and its worker processes, through shared memory.

Messages carry their tensors through an :class:`Arena` per worker and direction: an anonymous shared mapping
made before the fork, so a tensor costs one copy in and one copy out. (torch's own sharing makes a shared
memory file per tensor and passes its descriptor over a socket: ~0.6 ms a tensor, 5 ms for an 8-tensor
upload, more than training a 60-sample client costs.) An arena is also plain shared memory for views
(:mod:`fedskew.engine.fold_workers` keeps the workers' running FedAvg sum in one).
"""

from __future__ import annotations

import io
import mmap
import pickle
from typing import Any

import torch

#: bytes of each arena (virtual: pages are only backed once written); larger messages are pickled whole
ARENA_BYTES = 1 << 30
#: alignment of every tensor in an arena
ALIGN = 64


class _ArenaPickler(pickle.Pickler):
    """Writes each plain CPU tensor's bytes into ``arena`` at the next aligned offset and pickles only the
    reference ``(offset, dtype, shape, requires_grad)``."""

    def __init__(self, file: io.BytesIO, arena: torch.Tensor) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arena, self.offset = arena, 0

    def persistent_id(self, o: Any) -> Any:
        if type(o) is not torch.Tensor or o.layout != torch.strided or o.device.type != "cpu":
            return None  # parameters and other subclasses keep their type: pickled inline
        flat = o.detach().contiguous().reshape(-1)
        n = flat.numel() * flat.element_size()
        if self.offset + n > self.arena.numel():
            return None  # does not fit: pickled inline
        if n:
            self.arena[self.offset : self.offset + n].copy_(flat.view(torch.uint8))
        pid = (self.offset, o.dtype, tuple(o.shape), o.requires_grad)
        self.offset += -(-n // ALIGN) * ALIGN
        return pid


class _ArenaUnpickler(pickle.Unpickler):
    """Rebuilds the tensors :class:`_ArenaPickler` referenced, as copies out of ``arena``."""

    def __init__(self, file: io.BytesIO, arena: torch.Tensor) -> None:
        super().__init__(file)
        self.arena = arena

    def persistent_load(self, pid: Any) -> torch.Tensor:
        offset, dtype, shape, requires_grad = pid
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        t = self.arena[offset : offset + n].view(dtype).reshape(shape).clone()
        return t.requires_grad_(requires_grad)


class Arena:
    """A shared anonymous memory mapping that carries the tensors of one message at a time.

    Made before the fork, it is the same memory in the parent and the worker. :meth:`dumps` pickles an
    object with each tensor's bytes written into the arena (referenced by offset); :meth:`loads` rebuilds it
    with copies, so the writer may reuse the arena as soon as the reader has loaded. The protocol keeps one
    message per arena in flight: a worker has one task at a time, and the parent loads its result before
    it sends that worker the next task.
    """

    def __init__(self, nbytes: int = ARENA_BYTES) -> None:
        while True:  # under strict overcommit accounting a large mapping may be refused: take less
            try:
                self._map = mmap.mmap(-1, nbytes)
                break
            except OSError:
                if nbytes <= 1 << 24:
                    raise
                nbytes //= 2
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # the shared bytes (views of it)

    def dumps(self, obj: Any) -> bytes:
        out = io.BytesIO()
        _ArenaPickler(out, self.tensor).dump(obj)
        return out.getvalue()

    def loads(self, data: bytes) -> Any:
        return _ArenaUnpickler(io.BytesIO(data), self.tensor).load()
