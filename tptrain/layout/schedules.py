"""The pipeline schedules as plain facts: their names, how many stages each rank holds, the microbatches they need,
and the even split of decoder layers into stages. Pure (no torch), so the rule table can check a pipeline before
torch.distributed.pipelining is imported; tests/test_layout.py checks the facts against torch's classes."""
from __future__ import annotations

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # 2 per rank
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2p-1-r: the first and the last on rank 0


def canonical(name: str) -> str | None:
    """The canonical spelling of a schedule (case-insensitive, as torch's get_schedule_class), or None."""
    return {s.lower(): s for s in SCHEDULES}.get(str(name).lower())


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE else 1


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest microbatches `schedule` runs at `pp` (torch refuses fewer)."""
    n_stages = pp * stages_per_rank(schedule)
    return 1 if schedule in ("GPipe", "LoopedBFS") else n_stages if schedule in V_SCHEDULES else pp


def microbatch_rounds(schedule: str, pp: int, n_microbatches: int) -> int | None:
    """The rounds a looped multi-stage schedule runs the microbatches in (they must divide them); None: no rounds."""
    if stages_per_rank(schedule) == 1 or schedule in V_SCHEDULES:
        return None
    return max(1, n_microbatches // pp)


def even_split(num_layers: int, n_stages: int) -> list[list[int]]:
    """Each stage's decoder layers, the embedding counted as one layer of the first stage and the head as one of the
    last (torchtitan's rule); `num_layers >= n_stages`."""
    units = num_layers + 2
    sizes = [units // n_stages + (s < units % n_stages) for s in range(n_stages)]
    sizes[0], sizes[-1] = sizes[0] - 1, sizes[-1] - 1
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def valid_layers(layers, num_layers: int, n_stages: int) -> bool:
    """Whether `layers` lists `n_stages` stages of consecutive decoder layers covering 0..num_layers-1 once each."""
    flat = [i for stage in layers for i in stage]
    return len(layers) == n_stages and flat == list(range(num_layers))
