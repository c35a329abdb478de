#!/usr/bin/python3
"""PyTorch reference for `dtrain train` (single process): the same models, data and optimizer.

Run with Debian's PyTorch (/usr/bin/python3, python3-torch 1.13), e.g.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
      /usr/bin/python3 bench/torch_reference.py --model gpt --steps 100 --eval-batches 10

Prints ONE JSON line shaped like dtrain's {"event":"final", ...} metrics record.
`--model gemm` instead measures PyTorch's own sgemm rate (n x n, float32) for comparison with
`dtrain bench gemm`.

`--dp N` (N >= 1) trains data-parallel like `dtrain train --dp N` instead: N processes
(torch.multiprocessing spawn), DistributedDataParallel over gloo (met through file://, a FileStore),
one thread each, `--batch-size` the GLOBAL batch split over the ranks (rank r takes slice r of
every global batch of one shared shuffled order, as dtrain does). `--dp 1` is one process
without a process group or DDP wrapper (the baseline for scaling efficiency), timed the same
way. Each step is timed, and the final record adds the rate over the steps after `--warmup`.
Without `--dp` the single-process behaviour above is unchanged.

`--backend dtrain` runs the same DDP program on dtrain's torch.distributed backend instead of
gloo (`import dtrain_torch` from `--dtrain-python`, default build/release/python). `--model
resnet18` is torchvision's ResNet-18 (10 classes) on generated images (`--image-size`, a fixed
set of `--images` N(0, 1) images with random labels from `--seed`), with SGD or AdamW like the
others. The final record's `losses` lists rank 0's loss at every step.
"""
import argparse
import datetime
import gzip
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FORTUNES_DIR = "/usr/share/games/fortunes"


# ----------------------------------------------------------------------------------------- data

def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion(directory):
    # Pixels stay uint8 (as torchvision keeps them); a batch is scaled to [0, 1] when drawn.
    def images(name):
        a = read_idx(os.path.join(directory, name))
        return torch.from_numpy(a.reshape(a.shape[0], -1).copy())

    def labels(name):
        return torch.from_numpy(read_idx(os.path.join(directory, name)).astype(np.int64))

    return (images("train-images-idx3-ubyte.gz"), labels("train-labels-idx1-ubyte.gz"),
            images("t10k-images-idx3-ubyte.gz"), labels("t10k-labels-idx1-ubyte.gz"))


def load_corpus(directory, val_fraction=0.1):
    """Every regular file (no symlinks, no file holding a NUL byte), sorted by name, as bytes."""
    chunks = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data:
            continue
        chunks.append(data)
    data = b"".join(chunks)
    split = int(math.floor(len(data) * (1.0 - val_fraction)))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t, (0, split), (split, len(data))


class TextSplit:
    def __init__(self, data, begin, end, seq_len):
        self.data, self.begin, self.seq_len = data, begin, seq_len
        self.size = max(0, (end - begin - 1) // seq_len)
        self.offsets = torch.arange(seq_len + 1)

    def get(self, indices):
        starts = self.begin + torch.as_tensor(indices, dtype=torch.int64) * self.seq_len
        w = self.data[starts[:, None] + self.offsets].long()
        return w[:, :-1], w[:, 1:]


# --------------------------------------------------------------------------------------- models

class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        dims = [784] + hidden + [10]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x


class Block(nn.Module):
    def __init__(self, C, H, L):
        super().__init__()
        self.H = H
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.fc = nn.Linear(C, 4 * C)
        self.fc_proj = nn.Linear(4 * C, C)
        for lin in (self.qkv, self.fc):
            nn.init.normal_(lin.weight, 0.0, 0.02)
        for lin in (self.proj, self.fc_proj):
            nn.init.normal_(lin.weight, 0.0, 0.02 / math.sqrt(2 * L))
        for lin in (self.qkv, self.proj, self.fc, self.fc_proj):
            nn.init.zeros_(lin.bias)

    def forward(self, x, mask):
        B, T, C = x.shape
        hd = C // self.H
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.H, hd).transpose(1, 2)
        k = k.view(B, T, self.H, hd).transpose(1, 2)
        v = v.view(B, T, self.H, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        x = x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, L, H, C, T, vocab=256):
        super().__init__()
        self.wte = nn.Embedding(vocab, C)
        self.wpe = nn.Embedding(T, C)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        nn.init.normal_(self.wpe.weight, 0.0, 0.02)
        self.blocks = nn.ModuleList(Block(C, H, L) for _ in range(L))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)
        self.lm_head = nn.Linear(C, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, 0.0, 0.02)
        # True above the diagonal = masked (future positions).
        self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1),
                             persistent=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.lm_head(self.ln_f(x))

    def non_embedding_params(self):
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith(("wte.", "wpe.")))


def gpt_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


# ------------------------------------------------------------------------------------- training

def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_optimizer(args, params):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def train(args, model, num_train, get_batch, loss_fn, tokens_per_sample):
    opt = make_optimizer(args, model.parameters())
    gen = torch.Generator().manual_seed(args.seed + 1)
    steps_per_epoch = num_train // args.batch_size
    if steps_per_epoch < 1:
        sys.exit(f"--batch-size {args.batch_size} is larger than the training set ({num_train})")
    model.train()
    losses = []
    train_time = 0.0
    perm = None
    for step in range(args.steps):
        if step % steps_per_epoch == 0:
            perm = torch.randperm(num_train, generator=gen)
        pos = (step % steps_per_epoch) * args.batch_size
        t0 = time.perf_counter()
        x, y = get_batch(perm[pos:pos + args.batch_size])
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
        val = loss.item()
        if not math.isfinite(val):
            sys.exit(f"loss is {val} at step {step + 1}: training diverged")
        losses.append(val)
    tail = losses[-50:]
    samples_per_s = args.steps * args.batch_size / train_time
    out = {"event": "final", "impl": "torch", "torch_version": torch.__version__,
           "threads": torch.get_num_threads(), "steps": args.steps, "batch_size": args.batch_size,
           "train_loss": sum(tail) / len(tail), "train_time_s": train_time,
           "samples_per_s": samples_per_s,
           "params": sum(p.numel() for p in model.parameters()), "losses": losses}
    if tokens_per_sample:
        out["tokens_per_s"] = samples_per_s * tokens_per_sample
    return out


def mlp_accuracy(model, xte, yte):
    """Test accuracy over the whole test set, in batches of 1000."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for b in range(0, xte.shape[0], 1000):
            x = xte[b:b + 1000].float().div_(255.0)
            correct += (model(x).argmax(-1) == yte[b:b + 1000]).sum().item()
    return correct / xte.shape[0]


def gpt_val_loss(model, val_split, B, eval_batches):
    """Validation: the first E*B windows in order (all when E = 0), sample-weighted mean loss;
    returns (loss, samples)."""
    model.eval()
    n = val_split.size
    batches = (n + B - 1) // B
    if eval_batches > 0:
        batches = min(batches, eval_batches)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(batches):
            idx = list(range(b * B, min(n, (b + 1) * B)))
            x, y = val_split.get(idx)
            total += gpt_loss(model(x), y).item() * len(idx)
            count += len(idx)
    return (total / count if count else 0.0), count


def run_mlp(args):
    xtr, ytr, xte, yte = load_fashion(args.data_dir or FASHION_DIR)
    torch.manual_seed(args.seed)
    model = MLP(args.hidden)
    out = train(args, model, xtr.shape[0], lambda i: (xtr[i].float().div_(255.0), ytr[i]), F.cross_entropy, 0)
    out["model"] = "mlp"
    out["test_accuracy"] = mlp_accuracy(model, xte, yte)
    return out


def run_gpt(args):
    data, (tb, te), (vb, ve) = load_corpus(args.data_dir or FORTUNES_DIR, args.val_fraction)
    T = args.seq_len
    train_split, val_split = TextSplit(data, tb, te, T), TextSplit(data, vb, ve, T)
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.heads, args.width, T)
    out = train(args, model, train_split.size, train_split.get, gpt_loss, T)
    out["model"] = "gpt"
    out["non_embedding_params"] = model.non_embedding_params()
    out["val_loss"], out["val_samples"] = gpt_val_loss(model, val_split, args.batch_size, args.eval_batches)
    return out


def run_gemm(args):
    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=c)
    iters, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=c)
        iters += 1
        dt = time.perf_counter() - t0
        if dt > 1.0:
            break
    return {"op": "sgemm", "impl": "torch", "n": n, "threads": torch.get_num_threads(),
            "iters": iters, "gflops": 2.0 * n ** 3 * iters / dt / 1e9}


# ------------------------------------------------------------------------------ data parallel

def generated_images(args):
    """--images images of 3 x S x S, N(0, 1), random labels of 10 classes, from --seed."""
    g = torch.Generator().manual_seed(args.seed + 2)
    S = args.image_size
    x = torch.randn(args.images, 3, S, S, generator=g)
    y = torch.randint(0, 10, (args.images,), generator=g)
    return x, y


def resnet18():
    import torchvision  # Debian's python3-torchvision

    return torchvision.models.resnet18(num_classes=10)


def dp_setup(args):
    """Model, data and per-rank batch function of --model, built the same on every rank."""
    if args.model == "resnet18":
        x, y = generated_images(args)
        torch.manual_seed(args.seed)
        return resnet18(), x.shape[0], (lambda i: (x[i], y[i])), F.cross_entropy, 0, None
    if args.model == "mlp":
        xtr, ytr, xte, yte = load_fashion(args.data_dir or FASHION_DIR)
        torch.manual_seed(args.seed)
        model = MLP(args.hidden)
        return model, xtr.shape[0], (lambda i: (xtr[i].float().div_(255.0), ytr[i])), F.cross_entropy, 0, \
            (xte, yte)
    data, (tb, te), (vb, ve) = load_corpus(args.data_dir or FORTUNES_DIR, args.val_fraction)
    T = args.seq_len
    train_split, val_split = TextSplit(data, tb, te, T), TextSplit(data, vb, ve, T)
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.heads, args.width, T)
    return model, train_split.size, train_split.get, gpt_loss, T, val_split


def dp_evaluate(args, model, held_out):
    """Rank 0 only, after training: test accuracy (mlp) or val loss (gpt) as run_mlp/run_gpt."""
    out = {}
    if args.model == "resnet18":
        return out
    if args.model == "mlp":
        out["test_accuracy"] = mlp_accuracy(model, *held_out)
    else:
        out["val_loss"], out["val_samples"] = gpt_val_loss(model, held_out, args.batch_size, args.eval_batches)
    return out


def dp_worker(rank, args, init_method):
    """One rank: trains, rank 0 prints the final JSON record. init_method None: under a launcher
    (env://)."""
    torch.set_num_threads(args.threads)
    world = args.dp
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        if args.backend == "dtrain":
            sys.path.insert(0, args.dtrain_python)
            import dtrain_torch  # noqa: F401  registers the backend "dtrain"
        if init_method:  # else under a launcher (dtrain launch, torchrun): env://
            init = dict(init_method=init_method, rank=rank, world_size=world)
        else:
            init = {}
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout), **init)
    model, num_train, get_batch, loss_fn, tokens_per_sample, held_out = dp_setup(args)
    params = sum(p.numel() for p in model.parameters())
    net = model
    if world > 1:
        # The GPT's causal mask is a constant bool buffer, the same on every rank, and gloo cannot
        # broadcast bool: DDP leaves it alone (dtrain has no buffers to sync either). ResNet-18's
        # BatchNorm statistics are broadcast from rank 0 at every step, as DDP does by default.
        buffers = [n for n, _ in model.named_buffers()] if args.model != "resnet18" else []
        if buffers:
            DDP._set_params_and_buffers_to_ignore_for_model(model, buffers)
        net = DDP(model, bucket_cap_mb=args.bucket_mb)  # broadcasts rank 0's parameters
        if args.comm_hook == "allreduce":  # torch's own hook: the bucket's all_reduce through its future
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.allreduce_hook)
        elif args.comm_hook == "noop":  # no communication at all: the ceiling of any backend's DDP
            def noop_hook(_state, bucket):
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut
            net.register_comm_hook(None, noop_hook)
        elif args.comm_hook == "sync":  # one element all_reduced per bucket, the gradients kept: the ranks
            one = torch.zeros(1)      # keep step as with any backend, moving (almost) no data

            def sync_hook(_state, bucket):
                return dist.all_reduce(one, async_op=True).get_future().then(lambda _: bucket.buffer())
            net.register_comm_hook(None, sync_hook)
        elif args.comm_hook == "torch-fp16":  # torch's own compressing hook, on any backend
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.comm_hook != "none":  # dtrain's compressed all_reduce with error feedback
            net.register_comm_hook(dtrain_torch.CompressionState(args.comm_hook), dtrain_torch.compression_hook)
    opt = make_optimizer(args, net.parameters())
    B = args.batch_size
    b = B // world
    gen = torch.Generator().manual_seed(args.seed + 1)  # same order on every rank
    steps_per_epoch = num_train // B
    if steps_per_epoch < 1:
        sys.exit(f"--batch-size {B} is larger than the training set ({num_train})")
    net.train()
    losses, step_times = [], []
    perm = None
    for step in range(args.steps):
        if step % steps_per_epoch == 0:
            perm = torch.randperm(num_train, generator=gen)
        pos = (step % steps_per_epoch) * B + rank * b
        t0 = time.perf_counter()
        x, y = get_batch(perm[pos:pos + b])
        loss = loss_fn(net(x), y)
        loss.backward()  # DDP all_reduces the gradient buckets during backward and waits for them
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        val = loss.item()
        if not math.isfinite(val):
            sys.exit(f"rank {rank}: loss is {val} at step {step + 1}: training diverged")
        losses.append(val)
    warm = min(args.warmup, args.steps - 1)
    tail = losses[-50:]
    # Four totals, then the time of each step after warm-up (one gather carries both).
    mine = torch.tensor([sum(step_times), sum(step_times[warm:]), sum(tail) / len(tail),
                         float(peak_rss_bytes())] + step_times[warm:], dtype=torch.float64)
    if world > 1:
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
    else:
        everyone = [mine]
    # Had the ranks waited for each other at every step and for nothing else, step k would have
    # taken the longest of their times (the lock-step time).
    lockstep_s = torch.stack(everyone)[:, 4:].max(dim=0).values.sum().item()
    if rank == 0:
        train_time, timed = mine[0].item(), mine[1].item()
        samples_per_s = args.steps * B / train_time
        rate_after = (args.steps - warm) * B / timed
        out = {"event": "final", "impl": "torch", "torch_version": torch.__version__, "model": args.model,
               "world": world, "ddp": world > 1, "backend": args.backend if world > 1 else None,
               "bucket_mb": args.bucket_mb if world > 1 else None, "threads": torch.get_num_threads(),
               "steps": args.steps, "batch_size": B, "batch_per_rank": b, "warmup": warm,
               "train_loss": sum(e[2].item() for e in everyone) / world,
               "train_time_s": train_time, "samples_per_s": samples_per_s,
               "timed_steps": args.steps - warm, "timed_s": timed, "samples_per_s_after_warmup": rate_after,
               "samples_per_s_lockstep": (args.steps - warm) * B / lockstep_s if lockstep_s > 0 else None,
               "train_time_s_per_rank": [e[0].item() for e in everyone],
               "peak_rss_bytes_per_rank": [int(e[3].item()) for e in everyone],
               "step_time_s_median": sorted(step_times[warm:])[len(step_times[warm:]) // 2],
               "params": params, "optimizer": args.optimizer, "comm_hook": args.comm_hook, "losses": losses}
        if tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * tokens_per_sample
            out["tokens_per_s_after_warmup"] = rate_after * tokens_per_sample
        if args.model == "gpt":
            out["non_embedding_params"] = model.non_embedding_params()
        out.update(dp_evaluate(args, model, held_out))
        out["peak_rss_bytes"] = peak_rss_bytes()
        print(json.dumps(out), flush=True)
    if world > 1:
        dist.barrier()  # rank 0 evaluates while the others wait, then all leave together
        dist.destroy_process_group()


def run_dp(args):
    if args.model not in ("mlp", "gpt", "resnet18"):
        sys.exit("--dp needs --model mlp, gpt or resnet18")
    if args.dp < 1 or args.batch_size % args.dp:
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of --dp {args.dp} (>= 1)")
    if args.steps < 1:
        sys.exit("--steps must be >= 1")
    if args.dp == 1:
        dp_worker(0, args, None)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.launched:  # this process is one rank of a world a launcher started
        rank = int(os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) != args.dp:
            sys.exit(f"--dp {args.dp} but WORLD_SIZE={os.environ['WORLD_SIZE']}")
        dp_worker(rank, args, None)
        return
    import tempfile
    import torch.multiprocessing as mp
    # The ranks meet through a file (torch's FileStore), not on a port found free here: rank 0
    # binds it only later, and another program may take it in between (a CI run under ctest -j2
    # failed so: "Address already in use", and a rank could reach that program instead).
    with tempfile.TemporaryDirectory(prefix="torch_reference.") as d:
        mp.spawn(dp_worker, args=(args, "file://" + os.path.join(d, "store")), nprocs=args.dp, join=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mlp", "gpt", "gemm", "resnet18"], default="mlp")
    p.add_argument("--hidden", default="1024,1024", help="MLP hidden widths")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (mlp), 16 (gpt)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (mlp), 3e-4 (gpt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=0, help="gpt: validation batches (0 = all)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--size", type=int, default=512, help="gemm: matrix size")
    p.add_argument("--dp", type=int, default=None,
                   help="data parallel: N processes, DDP over gloo (see above); --batch-size is global")
    p.add_argument("--warmup", type=int, default=0, help="--dp: steps left out of samples_per_s_after_warmup")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="--dp: DDP bucket_cap_mb")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="--dp: process group timeout (s)")
    p.add_argument("--backend", choices=["gloo", "dtrain"], default="gloo", help="--dp: torch.distributed backend")
    p.add_argument("--dtrain-python", default=os.environ.get(
        "DTRAIN_TORCH_PATH", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build",
                                          "release", "python")),
        help="--backend dtrain: the folder holding the dtrain_torch package")
    p.add_argument("--launched", action="store_true",
                   help="--dp: started by a launcher (dtrain launch, torchrun) as one rank: env:// rendezvous")
    p.add_argument("--comm-hook",
                   choices=["none", "allreduce", "noop", "sync", "torch-fp16", "bf16", "fp16", "int8", "int4"],
                   default="none",
                   help="--dp: DDP communication hook: torch's allreduce_hook; noop, which communicates nothing "
                        "(each rank keeps its own gradients: the throughput no backend can beat); sync, which "
                        "all_reduces one element per bucket through a Python future callback and keeps the gradients "
                        "(the ranks keep step, as with any backend, and move almost no data); torch-fp16, torch's "
                        "fp16_compress_hook (any backend); or "
                        "dtrain_torch.compression_hook with that codec (--backend dtrain)")
    p.add_argument("--image-size", type=int, default=32, help="resnet18: image side")
    p.add_argument("--images", type=int, default=2048, help="resnet18: generated images")
    args = p.parse_args()
    args.hidden = [int(h) for h in args.hidden.split(",") if h]
    if args.batch_size is None:
        args.batch_size = {"gpt": 16, "resnet18": 16}.get(args.model, 64)
    if args.lr is None:
        args.lr = 3e-4 if args.model == "gpt" else 1e-3
    if args.comm_hook not in ("none", "allreduce", "noop", "sync", "torch-fp16") and args.backend != "dtrain":
        sys.exit(f"--comm-hook {args.comm_hook} is dtrain's compressed all_reduce: it needs --backend dtrain")
    if args.model == "resnet18" and args.dp is None:
        sys.exit("--model resnet18 runs with --dp N (N >= 1)")
    torch.set_num_threads(args.threads)
    if args.dp is not None:
        run_dp(args)  # prints its own record (rank 0)
        return
    out = {"mlp": run_mlp, "gpt": run_gpt, "gemm": run_gemm}[args.model](args)
    out["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
