"""gpu_check.py's comm part: every collective of tptrain.distributed.comm on the job's default group (NCCL when each
rank has a GPU) against the same call on a gloo group over the same ranks (CPU tensors, fp32), on the same inputs
rounded to the dtype under test. One row per collective and dtype: outputs (and input gradients, for the autograd
ones) within the dtype's tolerance on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tptrain.distributed import comm

H = 8  # features of every test tensor


def _splits(rank: int, world: int) -> tuple[list[int], list[int]]:
    """Uneven all-to-all splits, zeros included (at 2 ranks or more): rank r sends (r + 2d + 1) % 3 rows to rank d."""
    return [(rank + 2 * d + 1) % 3 for d in range(world)], [(s + 2 * rank + 1) % 3 for s in range(world)]


def _started(pending: comm.Pending, device: torch.device) -> torch.Tensor:
    """Queue compute on the current stream while the collective runs, then read its result there (a copy): without
    the stream wait in `Pending.wait()` that copy could run before NCCL has written the buffer."""
    a = torch.randn(256, 256, device=device)
    for _ in range(8):
        a = torch.tanh(a @ a)
    return pending.wait().clone()


def _cases(rank: int, world: int) -> dict[str, tuple[tuple[int, ...], object, bool]]:
    """{name: (input shape, f(x, group), differentiable)}."""
    send, recv = _splits(rank, world)
    seq = (2, 2 * world, H)  # (batch, seq, features), seq divisible by the world
    return {
        "copy_to_tp": ((3, H), comm.copy_to_tp, True),
        "reduce_from_tp": ((3, H), comm.reduce_from_tp, True),
        "sum_over_tp": ((3, H), comm.sum_over_tp, True),
        "gather_from_tp": ((2, 3, H), lambda x, g: comm.gather_from_tp(x, g, dim=-1), True),
        "split_to_tp": ((2 * world, H), lambda x, g: comm.split_to_tp(x, g, dim=0), True),
        "gather_to_sp": ((2, 3, H), lambda x, g: comm.gather_to_sp(x, g, dim=1), True),
        "reduce_scatter_to_sp": (seq, lambda x, g: comm.reduce_scatter_to_sp(x, g, dim=1), True),
        "dispatch_to_ranks (uneven)": ((sum(send), H), lambda x, g: comm.dispatch_to_ranks(x, g, send, recv), True),
        "all_reduce": ((3, H), lambda x, g: comm.all_reduce(x.clone(), g), False),
        "all_gather": ((2, 3, H), lambda x, g: comm.all_gather(x, g, dim=1), False),
        "reduce_scatter": (seq, lambda x, g: comm.reduce_scatter(x, g, dim=1), False),
        "all_to_all (uneven)": ((sum(send), H), lambda x, g: comm.all_to_all(x, g, send_splits=send,
                                                                            recv_splits=recv), False),
        "start_all_reduce": ((3, H), lambda x, g: _started(comm.start_all_reduce(x.clone(), g), x.device), False),
        "start_all_gather": ((2, 3, H), lambda x, g: _started(comm.start_all_gather(x, g, dim=1), x.device), False),
        "start_reduce_scatter": (seq, lambda x, g: _started(comm.start_reduce_scatter(x, g, dim=1), x.device),
                                 False),
    }


def _randn(shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded on the CPU, rounded to `dtype`, as fp32: the same numbers whichever backend consumes them."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).float()


def _call(fn, shape, differentiable: bool, seed: int, group, device, dtype, rounding) -> list[torch.Tensor]:
    """[output, input gradient] (fp32, CPU) of fn on inputs rounded to `rounding`, run in `dtype` on `device`."""
    x = _randn(shape, seed, rounding).to(device, dtype).requires_grad_(differentiable)
    y = fn(x, group)
    if not differentiable:
        return [y.float().cpu()]
    y.backward(_randn(y.shape, seed + 1, rounding).to(device, dtype))
    return [y.detach().float().cpu(), x.grad.float().cpu()]


def _compare(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> tuple[float, bool, str]:
    """(max abs error, every tensor within tol x its largest reference magnitude (at least 1), what differed)."""
    err, ok, notes = 0.0, True, []
    for what, a, b in zip(("output", "input grad"), got, ref):
        if a.shape != b.shape:
            return float("inf"), False, f"{what} shape {tuple(a.shape)}, gloo {tuple(b.shape)}"
        e = (a - b).abs().max().item() if a.numel() else 0.0
        scale = max(b.abs().max().item() if b.numel() else 0.0, 1.0)
        err, ok = max(err, e), ok and e <= tol * scale
        notes += [f"{what} err {e:.3g} (largest {scale:.3g})"] if e > tol * scale else []
    return err, ok, "; ".join(notes)


def _against_gloo(fn, shape, differentiable: bool, seed: int, groups, device, dtype, tol) -> tuple[float, bool, str]:
    """fn on the default group (`device`, `dtype`) against fn on the gloo group (CPU, fp32), inputs rounded to dtype."""
    default, gloo = groups
    ref = _call(fn, shape, differentiable, seed, gloo, torch.device("cpu"), torch.float32, dtype)
    return _compare(_call(fn, shape, differentiable, seed, default, device, dtype, dtype), ref, tol)


def _checked(fn, *args) -> tuple[float | None, bool, str]:
    """fn(*args), or a failure naming the exception."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure, the next check still runs
        return None, False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _agreement(rank: int, world: int, gloo) -> dict[str, tuple[float | None, bool, str]]:
    """any_rank on both groups, raise_on_any_rank, all_gather_object and barrier on the default group."""
    last = world - 1

    def any_rank(group):
        found = comm.any_rank(rank == last, group, phase="check"), comm.any_rank(False, group, phase="check")
        return None, found == (True, False), f"any_rank(one True, all False) gave {found}"

    def raise_on_any_rank():
        comm.raise_on_any_rank(None)
        expected = "boom" + (f" (on rank {last} of {world})" if world > 1 else "")
        try:
            comm.raise_on_any_rank("boom" if rank == last else None)
        except OSError as exc:
            return None, str(exc) == expected, f"raised {exc!r}, expected {expected!r}"
        return None, False, "raised nothing"

    def gather_object():
        got = comm.all_gather_object({"rank": rank})
        comm.barrier()
        return None, got == [{"rank": r} for r in range(world)], f"all_gather_object gave {got}"

    return {"any_rank (default group)": _checked(lambda: any_rank(None)),
            "any_rank (gloo group)": _checked(lambda: any_rank(gloo)),
            "raise_on_any_rank": _checked(raise_on_any_rank),
            "all_gather_object, barrier": _checked(gather_object)}


def comm_part(run) -> None:
    """Every check on every rank; rank 0 writes one row per check (worst error over ranks, failed on any)."""
    gloo = comm.side_group()  # a gloo group over every rank: the reference
    default = dist.group.WORLD
    results = {}  # case: (relative tolerance, (max abs error, ok, what went wrong))
    for dtype in (torch.float32, torch.bfloat16):
        for i, (name, (shape, fn, grad)) in enumerate(_cases(run.rank, run.world).items()):
            seed = 1000 * i + 10 * run.rank
            results[f"{name} {str(dtype).removeprefix('torch.')}"] = run.tol(dtype), _checked(
                _against_gloo, fn, shape, grad, seed, (default, gloo), run.device, dtype, run.tol(dtype))
    counts = torch.arange(2 * run.world, dtype=torch.int64) + 100 * run.rank
    results["exchange_counts int64"] = 0.0, _checked(lambda: _compare(
        [comm.exchange_counts(counts.to(run.device), default).cpu().float()],
        [comm.exchange_counts(counts, gloo).float()], 0.0))
    results.update({case: (None, r) for case, r in _agreement(run.rank, run.world, gloo).items()})
    ranks = comm.all_gather_object(results, group=gloo)
    for case, (tol, _) in results.items():
        per_rank = [r[case][1] for r in ranks]
        errs = [e for e, _, _ in per_rank if e is not None]
        failed = [f"rank {r}: {note}" for r, (_, ok, note) in enumerate(per_rank) if not ok]
        run.emit("comm", case, check="FAIL" if failed else "ok", err=max(errs) if errs else None, tol=tol,
                 note="; ".join(failed))
