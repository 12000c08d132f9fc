"""What one accelerator can do, for `tptrain plan --train`'s step-time estimate and its memory budget.

    profile = device_profile("h100")            # a named profile: datasheet peaks
    profile = device_profile("cpu")             # this machine, measured once per process (~0.3 s)
    budget = parse_memory("80GB")               # 80_000_000_000 bytes

A profile is the peak dense matmul rate in bf16 and in fp32 (fp32 without TF32: torch's default for matmuls), the
memory bandwidth, the bandwidth of one rank's link inside a node and between nodes (one direction), the memory of
one device, the devices a node holds and the memory the runtime keeps for itself (CUDA context, NCCL buffers; not
tensor memory). Datasheet peaks are never reached: `efficiency` is the fraction of them a well-fed large matmul
gets (MFU-like), applied by the step-time model to every profile alike. The `cpu` profile is measured here: a
one-thread fp32 and bf16 matmul, a large copy, a local socket's throughput (gloo's transport on one machine); its
ranks share the machine's cores and memory (`shared`), so a rank's share shrinks with the number of ranks.
"""
from __future__ import annotations

import functools
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, replace

GB, GiB = 10**9, 2**30


@dataclass(frozen=True)
class DeviceProfile:
    """name; kind ("cuda" or "cpu": what the kernels save differs, e.g. CPU attention under context parallelism);
    memory_bytes: one device's memory (a CPU: the machine's, shared by its ranks); bf16_flops / fp32_flops: peak
    dense matmul FLOP/s; memory_bw: bytes/s; intra_node_bw / inter_node_bw: one rank's link, bytes/s each way;
    devices_per_node; runtime_bytes: memory the runtime holds beside the tensors; efficiency: the fraction of the
    peaks a large matmul or transfer reaches; shared: the ranks share one machine's cores and memory (CPU);
    cores: the cores they share; overlaps_comm: collectives run beside compute (CUDA streams), not in line;
    collective_rates: ((collective, fraction of the link it reaches), ...) where a backend's collectives are
    slower than its links (gloo's)."""

    name: str
    kind: str
    memory_bytes: int
    bf16_flops: float
    fp32_flops: float
    memory_bw: float
    intra_node_bw: float
    inter_node_bw: float
    devices_per_node: int = 8
    runtime_bytes: int = GiB
    efficiency: float = 0.5
    shared: bool = False
    cores: int = 1
    overlaps_comm: bool = True
    collective_rates: tuple[tuple[str, float], ...] = ()

    def collective(self, op: str) -> float:
        """The fraction of the link's bandwidth collective `op` reaches (1 unless the profile says less)."""
        return dict(self.collective_rates).get(op, 1.0)

    def flops(self, bf16: bool) -> float:
        return self.bf16_flops if bf16 else self.fp32_flops

    def memory_per_rank(self, world_on_node: int) -> int:
        """The memory one rank may use: the device's, or a share of a shared machine's."""
        return self.memory_bytes // max(1, world_on_node) if self.shared else self.memory_bytes

    def compute_share(self, world_on_node: int) -> float:
        """The fraction of one core (CPU) or of one device a rank computes with."""
        return min(1.0, self.cores / max(1, world_on_node)) if self.shared else 1.0


def _gpu(name: str, memory_gb: float, bf16_tflops: float, fp32_tflops: float, hbm_tbs: float, link_gbs: float,
         net_gbs: float, per_node: int = 8) -> DeviceProfile:
    return DeviceProfile(name, "cuda", int(memory_gb * GB), bf16_tflops * 1e12, fp32_tflops * 1e12, hbm_tbs * 1e12,
                         link_gbs * 1e9, net_gbs * 1e9, devices_per_node=per_node)


# Datasheet figures (dense, no sparsity): NVIDIA H100 SXM5 / H200 / B200 / A100 SXM4 / L40S / A10G and AMD MI300X.
# Links: NVLink's bandwidth one way per GPU (H100/H200 900 GB/s both ways, B200 1.8 TB/s, A100 600 GB/s), PCIe
# 4.0 x16 for the cards without NVLink; the network: one 400 Gb/s (H100, H200, MI300X), 800 Gb/s (B200) or 200 Gb/s
# (A100) NIC per GPU.
PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    _gpu("h100", 80, 989, 67, 3.35, 450, 50),
    _gpu("h200", 141, 989, 67, 4.8, 450, 50),
    _gpu("b200", 180, 2250, 80, 8.0, 900, 100),
    _gpu("a100-80gb", 80, 312, 19.5, 2.04, 300, 25),
    _gpu("a100-40gb", 40, 312, 19.5, 1.555, 300, 25),
    _gpu("l40s", 48, 362, 91.6, 0.864, 32, 25),
    _gpu("a10g", 24, 125, 31.2, 0.6, 32, 12.5, per_node=4),
    _gpu("mi300x", 192, 1307, 163.4, 5.3, 448, 50),
)}
DEVICES = (*PROFILES, "cpu")


def device_profile(name: str) -> DeviceProfile:
    """The named profile ("cpu": this machine, measured); ValueError listing the names for an unknown one."""
    key = str(name).lower()
    if key == "cpu":
        return cpu_profile()
    if key not in PROFILES:
        raise ValueError(f"unknown device {name!r}; the profiles are {', '.join(DEVICES)} (or give the memory alone: "
                         f"--gpu-memory 80GB)")
    return PROFILES[key]


def with_memory(profile: DeviceProfile, memory_bytes: int) -> DeviceProfile:
    """`profile` with `memory_bytes` of memory per device (`--gpu-memory`)."""
    return replace(profile, name=f"{profile.name} ({memory_bytes / GB:g} GB)", memory_bytes=memory_bytes)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GiB,
          "tib": 2**40}


def parse_memory(text: str) -> int:
    """"80GB", "80 GiB", "81920MiB", "8e10" -> bytes; ValueError naming the accepted spellings."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"memory {text!r} is not a size; write e.g. 80GB, 96GiB or 40000MB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@functools.cache
def cpu_profile() -> DeviceProfile:
    """This machine, measured once per process: one thread's matmul rates (each rank of a CPU run computes on one
    thread, as torchrun sets OMP_NUM_THREADS=1), a copy's bandwidth, a local socket's (gloo's transport between the
    ranks of one machine), its cores and memory."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = _matmul_rate(torch.float32), _matmul_rate(torch.bfloat16)
        copy_bw = _copy_rate()
    finally:
        torch.set_num_threads(threads)
    link = _socket_rate()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return DeviceProfile("cpu", "cpu", _machine_memory(), bf16, fp32, copy_bw, link, link, devices_per_node=1 << 20,
                         runtime_bytes=0, efficiency=1.0, shared=True, cores=cores, overlaps_comm=False,
                         collective_rates=GLOO_RATES)


# gloo's collectives between the processes of one machine, as fractions of a local socket's throughput (torch 2.13,
# 16 MiB fp32, 2 ranks): its all-reduce pipelines, its all_gather_into_tensor / reduce_scatter_tensor go through
# per-rank copies and reductions on the calling thread.
GLOO_RATES = (("all_reduce", 0.3), ("all_to_all", 0.15), ("all_gather", 0.04), ("reduce_scatter", 0.025))


def _best_time(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_rate(dtype) -> float:
    import torch

    n = 384
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b))


def _copy_rate() -> float:
    import torch

    src = torch.empty(1 << 23)  # 32 MiB: past the caches
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_time(lambda: dst.copy_(src))


def _socket_rate(nbytes: int = 1 << 24) -> float:
    """Bytes/s one way through a local socket pair (a reader thread drains it), the best of three."""
    return max(_socket_once(nbytes) for _ in range(3))


def _socket_once(nbytes: int) -> float:
    left, right = socket.socketpair()
    payload = bytes(1 << 20)

    def drain() -> None:
        got = 0
        while got < nbytes:
            got += len(right.recv(1 << 20))

    with left, right:
        reader = threading.Thread(target=drain)
        start = time.perf_counter()
        reader.start()
        for _ in range(nbytes // len(payload)):
            left.sendall(payload)
        reader.join()
        return nbytes / (time.perf_counter() - start)


def _machine_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
