#!/usr/bin/python3
"""dtrain's AdamW with 8-bit optimizer state against f32 state, side by side in one run, one thread each.

    /usr/bin/python3 bench/optimizer_state.py [--repeats 1] [--gpt-steps 1000] [--mlp-epochs 1]

Each repeat trains the GPT and the MLP once with `--optimizer-state f32` and once with
`--optimizer-state int8` (same seed, the order alternating between repeats), then prints medians
[min-max] and the ratios int8/f32 against issue 25's goals for 8-bit state: optimizer bytes at
least 3.9x fewer (`optimizer_state_bytes` of the final record: what the optimizer holds), GPT
validation loss within 1% after 1000 steps, MLP test accuracy within 0.3 points. Speed
(tokens/s, samples/s) is printed for the cost of (de)quantizing, without a goal. See
bench/README.md.
"""
import time

from flag_compare import Table, alternate, cpu, parse, write


def main():
    a = parse(__doc__, 1, "optimizer_state.json")
    jobs = a.job_list
    started = time.perf_counter()
    runs = alternate(a, jobs, "--optimizer-state", ["f32", "int8"], not a.quiet)
    for j in jobs:
        for state, recs in runs[j].items():
            assert all(rec.get("optimizer_state") == state for rec in recs), recs

    print(f"dtrain --optimizer-state int8 against f32 (AdamW), one thread, {a.repeats} repeat(s), alternating order; "
          f"gpt {a.gpt_steps} steps, mlp {a.mlp_epochs} epoch(s)")
    model, vector = cpu()
    t = Table(runs, "f32", "int8", ratio_digits=4)
    for j in jobs:
        t.add(j, "optimizer_state_bytes", lambda rec: rec["optimizer_state_bytes"], 0, ("ratio<=", 1 / 3.9))
        if j == "gpt":
            t.add(j, "val_loss", lambda rec: rec["val_loss"], 4, ("within", 0.01) if a.gpt_steps >= 1000 else None)
            t.add(j, "tokens_per_s", lambda rec: rec["tokens_per_s"], 0)
        else:
            t.add(j, "test_accuracy_%", lambda rec: 100 * rec["test_accuracy"], 2, ("points", 0.3))
            t.add(j, "samples_per_s", lambda rec: rec["samples_per_s"], 0)
        t.add(j, "train_loss", lambda rec: rec["train_loss"], 4)
        t.add(j, "peak_rss_MiB", lambda rec: rec["wait4_peak_rss_bytes"] / 2**20, 1)
    t.print()
    elapsed = time.perf_counter() - started
    print("goals: optimizer bytes int8/f32 <= 1/3.9; gpt val loss within 1% (checked with --gpt-steps >= 1000); "
          "mlp test accuracy within 0.3 points")
    print(f"took {elapsed:.0f} s")
    write(a, model, vector, t, runs, elapsed_s=elapsed)


if __name__ == "__main__":
    main()
