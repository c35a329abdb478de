#!/usr/bin/python3
"""examples/torch_cnn.cpp's model and training loop in Python PyTorch, DistributedDataParallel
over gloo: the reference of bench/libtorch_ddp_compare.py.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p /usr/bin/python3 bench/torch_cnn_gloo.py \
        --bench 30 --batch-size 64

Same CNN (conv 3x3 32, conv 3x3 64, max-pool 2, fc 9216-128, fc 128-10), same data
(Fashion-MNIST, normalised), same global batch split between ranks, SGD with momentum, one
thread per process; times --bench steps after 5 warm-up steps and prints, on rank 0, a JSON
line with samples/s, as the C++ example does.
"""
import argparse
import gzip
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, images):
        x = F.relu(self.conv1(images))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load(directory, prefix):
    with gzip.open(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz")) as f:
        pixels = f.read()
    with gzip.open(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = f.read()
    n = int.from_bytes(pixels[4:8], "big")
    images = torch.frombuffer(bytearray(pixels[16:]), dtype=torch.uint8).view(n, 1, 28, 28).float().div_(255)
    return images.sub_(0.2860).div_(0.3530), torch.frombuffer(bytearray(labels[8:]), dtype=torch.uint8).long()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64, help="global")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.batch_size % world:
        raise SystemExit(f"--batch-size {a.batch_size} is not a multiple of the {world} ranks")
    images, labels = load(a.data, "train")
    torch.manual_seed(rank)
    model = nn.parallel.DistributedDataParallel(Cnn())
    sgd = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    per_rank = a.batch_size // world
    order = list(range(images.shape[0]))
    random.Random(0).shuffle(order)
    started = time.perf_counter()
    for step in range(a.bench + 5):
        if step == 5:
            started = time.perf_counter()
        begin = (step * a.batch_size + rank * per_rank) % (len(order) - a.batch_size)
        idx = torch.tensor(order[begin:begin + per_rank])
        loss = F.cross_entropy(model(images.index_select(0, idx)), labels.index_select(0, idx))
        loss.backward()
        sgd.step()
        sgd.zero_grad()
    seconds = time.perf_counter() - started
    if rank == 0:
        print(json.dumps({"world": world, "per_rank_batch": per_rank, "steps": a.bench,
                          "samples_per_s": a.bench * a.batch_size / seconds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
