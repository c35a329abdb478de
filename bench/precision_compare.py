#!/usr/bin/python3
"""dtrain with bf16 products against dtrain in f32, side by side in one run, one thread each.

    /usr/bin/python3 bench/precision_compare.py [--repeats 3] [--gpt-steps 1000] [--mlp-epochs 1]

Each repeat trains the GPT and the MLP once with `--precision f32` and once with `--precision
bf16` (same seed, the order alternating between repeats), then prints medians [min-max] and the
ratios bf16/f32 of tokens/s and samples/s, validation loss and test accuracy, against issue 21's
goals: GPT tokens/s at least 1.6x, validation loss within 2% (after 1000 steps), MLP test accuracy
within 0.3 points. The header names the CPU and the route bf16 products took (`bf16_route` of
dtrain's final record). See bench/README.md.
"""

from flag_compare import Table, alternate, cpu, parse, write


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
    write(a, model, vector, t, runs, bf16_route=route)


if __name__ == "__main__":
    main()
