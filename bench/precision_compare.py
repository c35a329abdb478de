#!/usr/bin/python3
"""dtrain with bf16 products against dtrain in f32, side by side in one run, one thread each.

    /usr/bin/python3 bench/precision_compare.py [--repeats 3] [--gpt-steps 1000] [--mlp-epochs 1] [--profile]

Each repeat trains the GPT and the MLP once with `--precision f32` and once with `--precision
bf16` (same seed, the order alternating between repeats), then prints medians [min-max] and the
ratios bf16/f32 of tokens/s and samples/s, validation loss and test accuracy, against issue 21's
goals: GPT tokens/s at least 1.6x, validation loss within 2% (after 1000 steps), MLP test accuracy
within 0.3 points. The header names the CPU and the route bf16 products took (`bf16_route` of
dtrain's final record). With --profile every run is profiled (dtrain --profile) and the products
ceiling is printed: bf16/f32 of the products alone (the gemms and the linear op's rounding of its
operands), what bf16 would give if every other op took no time. See bench/README.md.
"""

import statistics

from flag_compare import Table, alternate, cpu, parse, write


# The op kinds of --profile that are products: the gemms ("matmul": every sgemm and bf16 gemm,
# the attention's included) and the linear op's own work around them (under bf16: rounding its
# input, weight and output gradient).
PRODUCT_KINDS = ("matmul", "linear")


def step_ms(rec, kinds=None):
    """ms per step of the profiled run: of `kinds` (exclusive times), or all of training."""
    prof = rec["profile"]
    if kinds is None:
        return 1e3 * prof["train_time_s"] / rec["steps"]
    return 1e3 * sum(k["forward_s"] + k["backward_s"] for name, k in prof["kinds"].items()
                     if name in kinds) / rec["steps"]


def products_ceiling(runs, jobs):
    """What bf16 could give if only the products took time: f32's products over bf16's (medians).
    bf16 changes only the products, so no speed-up of the rest raises bf16/f32 above it."""
    print("\nproducts ceiling (--profile; medians, ms per step): bf16/f32 if every other op took no time")
    for j in jobs:
        med = {v: statistics.median(step_ms(r, PRODUCT_KINDS) for r in runs[j][v]) for v in ("f32", "bf16")}
        tot = {v: statistics.median(step_ms(r) for r in runs[j][v]) for v in ("f32", "bf16")}
        print(f"  {j}: step f32 {tot['f32']:.2f} bf16 {tot['bf16']:.2f} ({tot['f32'] / tot['bf16']:.3f}x); products "
              f"f32 {med['f32']:.2f} bf16 {med['bf16']:.2f}, the rest f32 {tot['f32'] - med['f32']:.2f} bf16 "
              f"{tot['bf16'] - med['bf16']:.2f}; ceiling {med['f32'] / med['bf16']:.3f}x")


def main():
    a = parse(__doc__, 3, "precision_compare.json")
    jobs = a.job_list
    runs = alternate(a, jobs, "--precision", ["f32", "bf16"], not a.quiet)

    route = next((rec.get("bf16_route") for j in jobs for rec in runs[j]["bf16"]), "?")
    print(f"dtrain --precision bf16 against f32, one thread, {a.repeats} repeat(s), alternating order; "
          f"gpt {a.gpt_steps} steps, mlp {a.mlp_epochs} epoch(s)")
    model, vector = cpu()
    print(f"bf16 route: {route}")
    t = Table(runs, "f32", "bf16")
    for j in jobs:
        if j == "gpt":
            t.add(j, "tokens_per_s", lambda rec: rec["tokens_per_s"], 0, ("ratio>=", 1.6))
            t.add(j, "val_loss", lambda rec: rec["val_loss"], 4, ("within", 0.02) if a.gpt_steps >= 1000 else None)
            t.add(j, "mfu_%", lambda rec: 100 * rec["mfu"], 1)
        else:
            t.add(j, "samples_per_s", lambda rec: rec["samples_per_s"], 0)
            t.add(j, "test_accuracy_%", lambda rec: 100 * rec["test_accuracy"], 2, ("points", 0.3))
        t.add(j, "train_loss", lambda rec: rec["train_loss"], 4)
    t.print()
    print("goals: gpt tokens/s bf16/f32 >= 1.6; val loss within 2% (checked with --gpt-steps >= 1000); "
          "mlp test accuracy within 0.3 points")
    if a.profile:
        products_ceiling(runs, jobs)
    write(a, model, vector, t, runs, bf16_route=route)


if __name__ == "__main__":
    main()
