"""The rows of the rule table that read what a training run (or an input) brings: the optimizer, the batch and its
microbatches, the sequence length. Checked by the Trainer and by `tptrain train` before any worker starts;
the sequence-length rows again on each input."""
from __future__ import annotations

from tptrain.layout import schedules
from tptrain.layout.case import Case, Rule, rule

ROWS: list[Rule] = []


def _schedule(c: Case) -> str:
    return schedules.canonical(c.features.pp_schedule) or c.features.pp_schedule


def _microbatches(c: Case) -> int:
    n = c.features.pp_microbatches
    return c.dims.pp if n is None else n  # 0 given is refused (`pp_microbatches`), not taken for the default


@rule(ROWS, "pp_microbatches", needs=("dims", "features.batch_size"),
      when="fewer microbatches than the schedule runs (pp_size; a V schedule: 2 x pp_size)",
      reason="torch's schedules need at least that many to fill the pipeline", fix="raise pp_microbatches")
def _pp_microbatches(c: Case, r: Rule) -> str | None:
    schedule, pp, n = _schedule(c), c.dims.pp, _microbatches(c)
    minimum = schedules.min_microbatches(schedule, pp)
    if pp > 1 and n < minimum:
        return (f"pipeline schedule {schedule} at pp_size={pp} needs at least {minimum} microbatches, got "
                f"pp_microbatches={n}; raise pp_microbatches (--pp-microbatches) to {minimum}")


@rule(ROWS, "pp_rounds", needs=("dims", "features.batch_size"),
      when="a looped schedule's microbatches not a multiple of its rounds (microbatches // pp_size)",
      reason="each round runs pp_size microbatches through both of a rank's stages", fix="a multiple of pp_size")
def _pp_rounds(c: Case, r: Rule) -> str | None:
    schedule, pp, n = _schedule(c), c.dims.pp, _microbatches(c)
    rounds = schedules.microbatch_rounds(schedule, pp, n)
    if pp > 1 and rounds is not None and n % rounds:
        return (f"pipeline schedule {schedule} needs pp_microbatches to be a multiple of the rounds "
                f"(pp_microbatches // pp_size = {rounds}), got {n}; use a multiple of {pp}")


@rule(ROWS, "pp_batch", needs=("dims", "features.batch_size"),
      when="per_device_train_batch_size not a multiple of pp_microbatches",
      reason="the schedule splits each micro-batch into equal microbatches", fix="a batch size that is a multiple")
def _pp_batch(c: Case, r: Rule) -> str | None:
    batch, n = c.features.batch_size, _microbatches(c)
    if c.dims.pp > 1 and n > 0 and batch % n:
        return (f"per_device_train_batch_size={batch} does not split into pp_microbatches={n} equal microbatches; "
                f"use a batch size that is a multiple of {n}")


@rule(ROWS, "cp_seq_len", needs=("dims", "features.seq_len"), when="a sequence length not a multiple of 2 x cp_size",
      reason="context parallelism cuts every sequence into 2 x cp_size equal chunks (head-tail load balancing)",
      fix="pad the batch (labels -100), or a seq_len that is a multiple of 2 x cp_size")
def _cp_seq_len(c: Case, r: Rule) -> str | None:
    seq, cp = c.features.seq_len, c.dims.cp
    multiple = 2 * cp
    if cp > 1 and seq % multiple:
        padded = -(-seq // multiple) * multiple
        return (f"context parallelism (cp_size={cp}) cuts every sequence into 2 x cp_size = {multiple} equal chunks, "
                f"but {c.spelling.seq_len} is {seq}, not a multiple of {multiple}; pad the batch to {padded} tokens "
                f"(labels -100), or use a seq_len (--seq-len) that is a multiple of {multiple}")


@rule(ROWS, "sp_seq_len", needs=("dims", "facts", "features.seq_len"),
      when="enable_sequence_parallel with a sequence length (over cp) not a multiple of tp_size",
      reason="sequence parallelism splits each sequence over the tp ranks",
      fix="a sequence length divisible by tp_size (pad with labels=-100), or disable enable_sequence_parallel")
def _sp_seq_len(c: Case, r: Rule) -> str | None:
    tp = c.dims.tp
    if c.features.sequence_parallel and tp > 1 and (c.features.seq_len // c.dims.cp) % tp:
        return (f"{c.facts.name}: sequence parallelism splits the sequence over tp_size={tp} ranks, but "
                f"{c.spelling.seq_len} is not a multiple of {tp}; choose a sequence length divisible by {tp} (pad a "
                f"batch with labels=-100, attention_mask=0 on the padding) or disable enable_sequence_parallel")


@rule(ROWS, "packed_documents", needs=("facts", "features.packing"),
      when="packed documents (samples one after another in a row, position ids restarting) on a model that cannot "
           "keep them apart (a token mixer outside attention it cannot restart at each document)",
      reason="attention's masks keep each document to itself and tptrain runs the recurrences and short convolutions "
             "it knows on each document alone; any other mixer would carry one document's state into the next",
      fix="train without packing (packing=False, --no-packing): one sample per row")
def _packed_documents(c: Case, r: Rule) -> str | None:
    if c.features.packing and c.facts.packing_refusal:
        return (f"{c.facts.name} ({c.facts.model_type}) cannot train on packed documents: {c.facts.packing_refusal}; "
                f"{r.fix}")
