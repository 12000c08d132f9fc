"""Every collective tptrain issues: the only package that talks to c10d. One file per concern:

    tracker.py        CommTracker: what passed through here (op, shape, bytes, phase, group size), and notes
    handles.py        collectives started without waiting (`start_*` -> `Pending.wait()`)
    collectives.py    the blocking collectives on plain tensors; a group's name
    ops.py            the activation collectives: Megatron's conjugate pairs as autograd functions over custom ops
    process_group.py  the process group's life: bounded rendezvous, timeouts, teardown at exit, a side store
    agreement.py      keeping the ranks in step: object gathers, barriers, any_rank, raise_on_any_rank

Callers read `comm.all_reduce(...)`, `comm.copy_to_tp(...)`, `comm.raise_on_any_rank(...)`: everything is
re-exported here.
"""
from tptrain.distributed.comm.agreement import (all_gather_object, any_rank, barrier, raise_on_any_rank, side_group,
                                               subgroup)
from tptrain.distributed.comm.collectives import (ProcessGroup, all_gather, all_reduce, all_to_all, group_name,
                                                  reduce_scatter, resolve_group, split)
from tptrain.distributed.comm.handles import Pending, start_all_gather, start_all_reduce, start_reduce_scatter
from tptrain.distributed.comm.ops import (copy_to_tp, dispatch_to_ranks, exchange_counts, gather_from_tp,
                                          gather_to_sp, on_gathered_over_cp, reduce_from_tp, reduce_scatter_to_sp,
                                          split_to_tp, sum_over_cp, sum_over_tp)
from tptrain.distributed.comm.process_group import (DEFAULT_PG_TIMEOUT, DEFAULT_RENDEZVOUS_TIMEOUT, PG_TIMEOUT_ENV,
                                                    RENDEZVOUS_TIMEOUT_ENV, destroy_process_group,
                                                    init_process_group, process_group_timeout, rendezvous_timeout,
                                                    shared_mesh, side_store, track_mesh)
from tptrain.distributed.comm.tracker import CommNote, CommRecord, CommTracker, note

__all__ = [
    "DEFAULT_PG_TIMEOUT", "DEFAULT_RENDEZVOUS_TIMEOUT", "PG_TIMEOUT_ENV", "RENDEZVOUS_TIMEOUT_ENV", "CommNote",
    "CommRecord", "CommTracker", "Pending", "ProcessGroup", "all_gather", "all_gather_object", "all_reduce",
    "all_to_all", "any_rank", "barrier", "copy_to_tp", "destroy_process_group", "dispatch_to_ranks", "exchange_counts",
    "gather_from_tp", "gather_to_sp", "group_name", "init_process_group", "note", "on_gathered_over_cp",
    "process_group_timeout", "raise_on_any_rank", "reduce_from_tp", "reduce_scatter",
    "reduce_scatter_to_sp", "rendezvous_timeout", "resolve_group", "side_group", "split", "split_to_tp",
    "start_all_gather", "start_all_reduce", "start_reduce_scatter", "subgroup", "sum_over_cp", "sum_over_tp",
    "shared_mesh", "side_store",
    "track_mesh",
]
