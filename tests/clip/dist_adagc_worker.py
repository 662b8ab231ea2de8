"""Worker for the 2-process gloo test of AdaGC on FSDP2 (DTensor) gradients: modes tensor and shard."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

STEPS = 4


def build():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (4, 17), generator=g)  # (B, T+1), split over 2 ranks


def loss_of(model, b):
    x, y = b[:, :-1], b[:, 1:]
    scale = 30.0 if b.shape[0] and int(b[0, 0]) % 3 == 0 else 1.0  # some steps spike
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1)) * scale


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradloc_track.clip import AdaGC

    model = build()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    tensor_mode = AdaGC(model, warmup_steps=1, lambda_abs=0.5, beta=0.9)
    shard_mode = AdaGC(model, warmup_steps=1, lambda_abs=0.5, beta=0.9, mode="shard")
    result = {"tensor_post": [], "shard_pre": [], "shard_coefs": [], "shard_collectives": []}
    real_all_reduce = dist.all_reduce
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss_of(model, batch(step).chunk(world)[rank]).backward()
        local = [p.grad.to_local().clone() for p in params]
        tensor_mode.clip()
        result["tensor_post"].append([float(p.grad.full_tensor().double().norm()) for p in params])  # all-gather
        for p, g in zip(params, local):
            p.grad.to_local().copy_(g)
        result["shard_pre"].append([g.double().norm().item() for g in local])
        calls = []

        def counting_all_reduce(*a, **k):
            calls.append("all_reduce")
            return real_all_reduce(*a, **k)

        dist.all_reduce = counting_all_reduce  # observe only
        try:
            res = shard_mode.clip()
        finally:
            dist.all_reduce = real_all_reduce
        result["shard_coefs"].append(res.coef_t.tolist())
        result["shard_collectives"].append(len(calls))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()  # both ranks finish before gloo is torn down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    print(f"rank {sys.argv[1]} done", flush=True)
    os._exit(0)  # skip interpreter teardown (gloo static destructors can abort on a loaded machine)
