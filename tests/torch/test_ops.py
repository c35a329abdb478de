"""Every operation x dtype x world size 1-4 through torch.distributed on the dtrain backend,
against gloo's results in the same processes (a gloo group beside the dtrain world).

Where gloo 1.13 has no such operation or dtype (bfloat16 and bool reductions, AVG,
reduce_scatter, all_gather_into_tensor, the list all_to_all), the reference is gloo's
result on a wider or bit-identical type or through the operation gloo does have (AVG: gloo's
SUM in float64 or int64, divided; reduce_scatter: gloo's all_reduce, this rank's block).

Bounds: inputs are small integers in every dtype, so sums and products are exact in any order:
results must be equal, bit for bit, for integers and floats alike, except AVG of floats
(within one ulp of the dtype: dtrain rounds sum / n once in the dtype's precision, the
reference through float64). One pass with random float32 / float64 inputs holds all_reduce's
sum within 2 n eps sum|x| of gloo's (summation order differs). Sub-groups (new_group) run
the collectives again on two subsets of ranks.
"""

import sys

import torch
import torch.distributed as dist

import util

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool]
OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
COUNTS = [1, 7, 1031]
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def op_name(op):
    return {R.SUM: "sum", R.AVG: "avg", R.PRODUCT: "product", R.MIN: "min", R.MAX: "max"}[op]


def applicable(dtype, op):
    return not (dtype == torch.bool and op == R.AVG)


def values(rank, count, dtype, op, salt=0):
    """Small integers: [-5, 5] ([-2, 2] for products), [0, 4] ([0, 2]) unsigned, {0, 1} bool."""
    i = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i * 3 + rank + salt) % 2).to(torch.bool) if op != R.PRODUCT else ((i + rank + salt) % 3 != 0)
    small = op == R.PRODUCT
    if dtype == torch.uint8:
        v = (i * 7 + rank * 3 + salt) % (3 if small else 5)
    else:
        v = (i * 7 + rank * 3 + salt) % (5 if small else 11) - (2 if small else 5)
    return v.to(dtype)


# ---- references through gloo -----------------------------------------------------------------


def movable(t):
    """A view of t that gloo moves (it has no bfloat16 or bool): same bytes."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.float16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


def ref_all_reduce(x, op, gloo):
    n = dist.get_world_size(gloo)
    if op == R.AVG:
        wide = x.to(torch.float64 if x.dtype in FLOATS else torch.int64, copy=True)
        dist.all_reduce(wide, R.SUM, group=gloo)
        if x.dtype in FLOATS:
            return (wide / n).to(x.dtype)
        return torch.div(wide, n, rounding_mode="trunc").to(x.dtype)
    if x.dtype == torch.bool:  # sum and max are "or", product and min "and"
        y = x.to(torch.uint8)
        dist.all_reduce(y, R.MAX if op in (R.SUM, R.MAX) else R.MIN, group=gloo)
        return y.to(torch.bool)
    if x.dtype == torch.bfloat16:
        y = x.float()
        dist.all_reduce(y, op, group=gloo)
        return y.to(torch.bfloat16)
    y = x.clone()
    dist.all_reduce(y, op, group=gloo)
    return y


def ref_all_gather(x, gloo):
    n = dist.get_world_size(gloo)
    outs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather([movable(o) for o in outs], movable(x), group=gloo)
    return outs


def same(a, b, dtype, op, what):
    if op == R.AVG and dtype in FLOATS:
        ok = torch.allclose(a.double(), b.double(), rtol=torch.finfo(dtype).eps, atol=0)
    else:
        ok = torch.equal(a, b)
    util.check(ok, what, "dtrain", a.flatten()[:8].tolist(), "reference", b.flatten()[:8].tolist())


# ---- the matrix --------------------------------------------------------------------------------


def collectives(group, gloo, ranks):
    """Every collective on `group` (dtrain) against `gloo`, both over the global `ranks`."""
    me = dist.get_rank()
    rank = ranks.index(me)
    n = len(ranks)
    for dtype in DTYPES:
        for count in COUNTS:
            tag = f"[n={n} {dtype} count={count}]"
            for op in OPS:
                if not applicable(dtype, op):
                    continue
                x = values(rank, count, dtype, op)
                a = x.clone()
                dist.all_reduce(a, op, group=group)
                same(a, ref_all_reduce(x, op, gloo), dtype, op, f"all_reduce {op_name(op)} {tag}")

                # reduce: the root's tensor holds the result, the others' stay as they were.
                root = ranks[-1]
                a = x.clone()
                dist.reduce(a, root, op, group=group)
                want = ref_all_reduce(x, op, gloo)  # every rank calls gloo
                want = want if me == root else x
                same(a, want, dtype, op, f"reduce {op_name(op)} {tag}")

                # reduce_scatter (list) and reduce_scatter_tensor: block `rank` of the all_reduce.
                blocks = [values(rank, count, dtype, op, salt=j) for j in range(n)]
                flat = torch.cat(blocks)
                want = ref_all_reduce(flat, op, gloo)[rank * count:(rank + 1) * count]
                out = torch.empty(count, dtype=dtype)
                dist.reduce_scatter(out, blocks, op, group=group)
                same(out, want, dtype, op, f"reduce_scatter {op_name(op)} {tag}")
                out = torch.empty(count, dtype=dtype)
                dist.reduce_scatter_tensor(out, flat, op, group=group)
                same(out, want, dtype, op, f"reduce_scatter_tensor {op_name(op)} {tag}")

            x = values(rank, count, dtype, R.SUM)
            for root in ranks:
                a, b = x.clone(), x.clone()
                dist.broadcast(a, root, group=group)
                dist.broadcast(movable(b), root, group=gloo)
                same(a, b, dtype, R.SUM, f"broadcast root {root} {tag}")

            want = ref_all_gather(x, gloo)
            outs = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(outs, x, group=group)
            for j in range(n):
                same(outs[j], want[j], dtype, R.SUM, f"all_gather block {j} {tag}")
            out = torch.empty(n * count, dtype=dtype)
            dist.all_gather_into_tensor(out, x, group=group)
            same(out, torch.cat(want), dtype, R.SUM, f"all_gather_into_tensor {tag}")

            root = ranks[n // 2]
            outs = [torch.empty_like(x) for _ in range(n)] if me == root else None
            dist.gather(x, outs, root, group=group)
            if me == root:
                ref = [torch.empty_like(x) for _ in range(n)]
                dist.gather(movable(x), [movable(r) for r in ref], root, group=gloo)
                for j in range(n):
                    same(outs[j], ref[j], dtype, R.SUM, f"gather block {j} {tag}")
            else:
                dist.gather(movable(x), None, root, group=gloo)

            chunks = [values(rank, count, dtype, R.SUM, salt=j) for j in range(n)] if me == root else None
            a, b = torch.empty_like(x), torch.empty_like(x)
            dist.scatter(a, chunks, root, group=group)
            dist.scatter(movable(b), [movable(c) for c in chunks] if chunks else None, root, group=gloo)
            same(a, b, dtype, R.SUM, f"scatter {tag}")

            # all_to_all_single, even and with uneven splits (rank r sends j + r + 1 rows to j).
            src = torch.cat([values(rank, count, dtype, R.SUM, salt=j) for j in range(n)])
            a, b = torch.empty_like(src), torch.empty_like(src)
            dist.all_to_all_single(a, src, group=group)
            dist.all_to_all_single(movable(b), movable(src), group=gloo)
            same(a, b, dtype, R.SUM, f"all_to_all_single {tag}")
            send = [j + rank + 1 for j in range(n)]
            recv = [rank + j + 1 for j in range(n)]
            src = values(rank, sum(send) * 2, dtype, R.SUM).view(-1, 2)
            a = torch.empty(sum(recv), 2, dtype=dtype)
            b = torch.empty_like(a)
            dist.all_to_all_single(a, src, recv, send, group=group)
            dist.all_to_all_single(movable(b), movable(src), recv, send, group=gloo)
            same(a, b, dtype, R.SUM, f"all_to_all_single uneven {tag}")

            # all_to_all (lists, blocks of different sizes); the reference: gloo's all_to_all_single.
            ins = [values(rank, count + j + rank, dtype, R.SUM, salt=j) for j in range(n)]
            outs = [torch.empty(count + rank + j, dtype=dtype) for j in range(n)]
            dist.all_to_all(outs, ins, group=group)
            ref = torch.empty(sum(o.numel() for o in outs), dtype=dtype)
            dist.all_to_all_single(movable(ref), movable(torch.cat(ins)), [o.numel() for o in outs],
                                   [i.numel() for i in ins], group=gloo)
            same(torch.cat(outs), ref, dtype, R.SUM, f"all_to_all {tag}")

            dist.barrier(group=group)


def point_to_point(n):
    rank = dist.get_rank()
    if n == 1:
        return
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        for count in (0, 1, 1031):
            x = values(rank, count, dtype, R.SUM)
            got = torch.empty_like(x)
            # blocking: even ranks send first, odd ranks receive first
            if rank % 2 == 0:
                dist.send(x, nxt)
                dist.recv(got, prv)
            else:
                dist.recv(got, prv)
                dist.send(x, nxt)
            same(got, values(prv, count, dtype, R.SUM), dtype, R.SUM, f"send/recv {dtype} {count}")
            # isend / irecv with tags, posted in any order
            got2 = torch.empty_like(x)
            reqs = [dist.irecv(got2, prv, tag=5), dist.isend(x, nxt, tag=5)]
            for r in reqs:
                r.wait()
            same(got2, values(prv, count, dtype, R.SUM), dtype, R.SUM, f"isend/irecv {dtype} {count}")


def random_sums(gloo, n):
    rank = dist.get_rank()
    for dtype in (torch.float32, torch.float64):
        for count in (1031, 100003):
            g = torch.Generator().manual_seed(1000 * rank + count)
            x = torch.randn(count, generator=g, dtype=dtype)
            a, b = x.clone(), x.clone()
            dist.all_reduce(a)
            dist.all_reduce(b, group=gloo)
            mag = x.abs()
            dist.all_reduce(mag, group=gloo)
            bound = 2 * n * torch.finfo(dtype).eps * mag
            util.check(bool(((a - b).abs() <= bound).all()), "random all_reduce", dtype, count,
                       float((a - b).abs().max()))


def zero_sized():
    """Empty tensors (gloo's all_gather of them dies of SIGFPE: checked against nothing)."""
    n = dist.get_world_size()
    x = torch.empty(0)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    outs = [torch.empty(0) for _ in range(n)]
    dist.all_gather(outs, x)
    out = torch.empty(0)
    dist.reduce_scatter(out, [torch.empty(0) for _ in range(n)])
    util.check(all(o.numel() == 0 for o in outs), "zero-sized")


def non_contiguous(gloo, n):
    """Strided tensors go through a copy and come back in place."""
    rank = dist.get_rank()
    base = torch.arange(40, dtype=torch.float32).view(8, 5) * (rank + 1)
    a, b = base.clone().t(), base.clone().t()  # (5, 8), non-contiguous
    dist.all_reduce(a[1:4])
    dist.all_reduce(b[1:4].contiguous(), group=gloo)  # the reference on a copy
    ref = base.clone().t()
    tmp = ref[1:4].contiguous()
    dist.all_reduce(tmp, group=gloo)
    ref[1:4] = tmp
    util.check(torch.equal(a, ref), "non-contiguous all_reduce")
    outs = [torch.empty(8, 5).t() for _ in range(n)]
    dist.all_gather(outs, base.t())
    for j in range(n):
        util.check(torch.equal(outs[j], (torch.arange(40, dtype=torch.float32).view(8, 5) * (j + 1)).t()),
                   "non-contiguous all_gather", j)


def worker(rank, n):
    world = list(range(n))
    gloo = dist.new_group(backend="gloo")
    collectives(None, gloo, world)
    point_to_point(n)
    random_sums(gloo, n)
    zero_sized()
    non_contiguous(gloo, n)
    # Sub-groups: every rank creates each group (new_group is collective over the world).
    subsets = [list(range(1, n)), [0, n - 1]] if n >= 3 else []
    for ranks in subsets:
        sub = dist.new_group(ranks)
        sub_gloo = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            util.check(dist.get_world_size(sub) == len(ranks), "sub-group size")
            collectives(sub, sub_gloo, ranks)
    dist.barrier()


def main():
    for n in (1, 2, 3, 4):
        util.run_world(worker, n, timeout_s=120)
        print(f"world {n}: every operation x dtype equals gloo's (sub-groups: {n >= 3})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
