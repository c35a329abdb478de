"""dtrain's collectives as a torch.distributed backend.

    import dtrain_torch            # registers the backend "dtrain"
    import torch.distributed as dist
    dist.init_process_group("dtrain")   # under dtrain launch, torchrun, or any init_method

Every torch.distributed operation on CPU tensors runs on dtrain (src/torch/process_group.cpp
says how tensors become buffers). dtrain's groups meet through torch's store. Under
`dtrain launch`, whose authenticated store holds MASTER_PORT, importing this module makes
torch's env:// rendezvous meet in that store too, for every backend (gloo included).

DDP communication hook with dtrain's compressed all_reduce and error feedback:

    model.register_comm_hook(dtrain_torch.CompressionState("int8"), dtrain_torch.compression_hook)
"""

import importlib
import os
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist

from . import _C

__all__ = ["CompressionState", "compression_hook", "ProcessGroupDtrain", "under_dtrain_launch"]

ProcessGroupDtrain = _C.ProcessGroupDtrain


def _create(options, pg_options):
    if pg_options is not None:
        raise ValueError("the dtrain backend takes no pg_options")
    # torch numbers its groups: "0" (or "") is the default group, new_group()s count from 1.
    name = "world" if options.group_id in ("", "0") else "group" + options.group_id
    return _C._create(options.store, options.group_rank, options.group_size, options.timeout, name)


if not hasattr(dist.Backend, "DTRAIN"):
    dist.Backend.register_backend("dtrain", _create, extended_api=True)


# ---- rendezvous under dtrain launch --------------------------------------------------------


def under_dtrain_launch():
    """True in a worker started by `dtrain launch` (its store, MASTER_ADDR:MASTER_PORT, is dtrain's)."""
    return os.environ.get("DTRAIN_STORE_HOSTED") == "1" and bool(os.environ.get("DTRAIN_SECRET"))


# The module (torch.distributed.rendezvous is also the name of a function in torch.distributed).
_rendezvous = importlib.import_module("torch.distributed.rendezvous")
_torch_env_handler = _rendezvous._rendezvous_handlers.get("env")


def _env_handler(url, timeout=timedelta(minutes=30), **kwargs):
    """env:// under dtrain launch: torch's store is a client of dtrain launch's authenticated
    store (MASTER_PORT is taken by it, so torch could not start its own TCPStore there).
    Elsewhere torch's own env:// handler."""
    if not under_dtrain_launch():
        yield from _torch_env_handler(url, timeout=timeout, **kwargs)
        return
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}

    def var(name, key):
        value = query.get(key, os.environ.get(name))
        if value is None:
            raise ValueError(f"dtrain_torch: environment variable {name} is not set")
        return value

    rank = int(var("RANK", "rank"))
    world_size = int(var("WORLD_SIZE", "world_size"))
    store = _C._connect_store(
        var("MASTER_ADDR", "master_addr"), int(var("MASTER_PORT", "master_port")), os.environ["DTRAIN_SECRET"], timeout
    )
    yield (store, rank, world_size)
    raise RuntimeError("dtrain_torch: env:// cannot rendezvous again under dtrain launch")


if _torch_env_handler is not None and _rendezvous._rendezvous_handlers.get("env") is not _env_handler:
    _rendezvous._rendezvous_handlers["env"] = _env_handler


# ---- DDP communication hook: dtrain's compressed all_reduce with error feedback -----------


class CompressionState:
    """State of compression_hook: the codec (none, bf16, fp16, int8, int4; comm/compress.h),
    the process group (None: the default one, which must be a dtrain group) and, with
    error_feedback, each bucket's residual: what compression lost at the last step, added to
    the bucket's next gradients, so that the sum of the updates over steps stays within one
    step's error of the exact one."""

    def __init__(self, codec="int8", error_feedback=True, process_group=None):
        if codec not in ("none", "bf16", "fp16", "int8", "int4"):
            raise ValueError(f"dtrain_torch.CompressionState: unknown codec {codec!r} (none, bf16, fp16, int8, int4)")
        self.codec = codec
        self.error_feedback = error_feedback
        self.process_group = process_group
        self.residuals = {}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def residual(self, index, buffer):
        r = self.residuals.get(index)
        if r is None or r.numel() != buffer.numel():  # first step, or DDP rebuilt its buckets
            r = torch.zeros_like(buffer, memory_format=torch.contiguous_format)
            self.residuals[index] = r
        return r


def compression_hook(state, bucket):
    """DDP communication hook: averages the bucket with dtrain's compressed all_reduce
    (register with model.register_comm_hook(CompressionState(...), compression_hook)).
    Buckets that are not float32 go through the plain all_reduce."""
    group = state.process_group or dist.distributed_c10d._get_default_group()
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32:
        world = group.size()
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))
    residual = None
    if state.error_feedback:
        residual = state.residual(bucket.index(), buffer)
        buffer.add_(residual)
    work = _C._allreduce_compressed(group, buffer, state.codec, "avg", residual)
    return work.get_future().then(lambda f: f.value()[0])
