"""Where a cross-device client's time goes on one worker, in one process (no Ray): the real
``ClientHost`` and server half of FedAvg on ``make gpu-check``'s cross-device shape (1,000 clients,
50 a round, the FedAvg CNN, batch 10, 1 epoch; its synthetic 32x32 stand-in for CIFAR-10), on the GPU
when there is one.

Prints, per variant, the median time per client over the rounds after the first (the device
synchronised at each round's end), the share of a round the GPU spent in kernels (torch profiler),
the CUDA calls that wait for the device, and cProfile's top functions. Variants: the downlink as the
worker receives it (CPU tensors, copied to the device by every client) and the downlink moved to the
device once per round. A development tool for the GPU path::

    python benchmarks/profile_client.py [--rounds 6] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_check import CROSS_DEVICE, SYNTHETIC

from fedray.platform.api.algorithm import sample_clients
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.runtime import devices
from fedray.platform.runtime.coordinator import build_server
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.state_store import ClientTask
from fedray.platform.runtime.worker import ClientHost, tensors_of, with_tensors

# check 5's cross-device shape, on the synthetic stand-in at CIFAR's size (no data to carry along)
SHAPE = [*CROSS_DEVICE, *SYNTHETIC]


def on(device: torch.device, tree: Any) -> Any:
    """``tree`` with its tensors moved to ``device``."""
    found: list[torch.Tensor] = []
    tensors_of(tree, found)
    return with_tensors(tree, iter([t.to(device) for t in found]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the first is warm-up)")
    gpu = torch.device(args.device).type == "cuda"
    cfg = load_config(None, [*SHAPE, f"ray.num_gpus_per_client={0.25 if gpu else 0}"])
    devices.assigned_gpu_ids = lambda: ("0",) if gpu else ()  # what Ray would assign this worker
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    host = ClientHost(cfg, num_threads=1)
    host.setup(meta)
    print(f"device {host.device_info.describe()}, torch {torch.__version__}", flush=True)
    server = build_server(cfg, meta)
    n = len(fed.shards)

    def one_round(rnd: int, downlink: Callable[[Any], Any]) -> float:
        selected = sample_clients(cfg.seed, rnd, n, clients_per_round(cfg))
        payloads = {c: downlink(p) for c, p in server.configure(rnd, selected).items()}
        tasks = [ClientTask(c, [fed.shards[c]]) for c in selected]
        sync(host.device)
        start = time.perf_counter()
        results = host.train(rnd, tasks, [[payloads[c]] for c in selected])
        sync(host.device)
        seconds = time.perf_counter() - start
        server.aggregate(rnd, {r.client: r.uplink for r in results})
        return seconds / len(selected)

    variants = {
        "downlink on the CPU (as received)": lambda p: p,
        "downlink on the device": lambda p: on(host.device, p),
    }
    rnd = 0
    for label, downlink in variants.items():
        times = []
        for _ in range(args.rounds):
            times.append(one_round(rnd, downlink))
            rnd += 1
        print(
            f"\n== {label}: per client {1e3 * statistics.median(times[1:]):.1f} ms "
            f"(rounds: {', '.join(f'{1e3 * t:.1f}' for t in times)})",
            flush=True,
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            wall = one_round(rnd, downlink) * clients_per_round(cfg)
        rnd += 1
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        print(
            f"   one round {wall * 1e3:.0f} ms, kernels {device_us / 1e3:.0f} ms "
            f"({100 * device_us / 1e6 / wall:.0f} % of the round)"
        )
        waits = [
            e for e in events if any(w in e.key for w in ("Synchronize", "Memcpy", "item", "_local_scalar"))
        ]
        for e in sorted(waits, key=lambda e: -e.cpu_time_total)[:8]:
            print(f"   {e.key:<40} calls {e.count:>6}  cpu {e.cpu_time_total / 1e3:8.1f} ms")
        profiler = cProfile.Profile()
        profiler.enable()
        one_round(rnd, downlink)
        profiler.disable()
        rnd += 1
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
