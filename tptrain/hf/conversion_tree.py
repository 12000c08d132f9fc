"""The trees a transformers load-time conversion builds over checkpoint tensors (tptrain/hf/conversions.py), each read
by box: `Tensor` leaves as stored; `Stack` (MergeModulelist), `Cat` (Concatenate), `Part` (Chunk), `Transposed`
(Transpose) and the row permutations `Interleaved` (Interleave) and `RopePermuted` (PermuteForRope) over them; a
`Converted` parameter reads only the box of its tree that this rank's `ShardSpec` holds (`local_box`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from tptrain.parallel.styles import ShardSpec

Box = dict[int, list[tuple[int, int]]]  # dim -> the [start, stop) ranges wanted along it, in order (absent: all)


@dataclass
class Tensor:
    """A checkpoint tensor as stored."""

    key: str
    shape: tuple[int, ...]

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        if not box:
            return reader.read(self.key, **kwargs)
        (dim, ranges), *rest = sorted(box.items())
        out = reader.read_ranges(self.key, dim=dim, ranges=ranges, **kwargs)
        for dim, ranges in rest:  # no plan splits a stored tensor along two dims; correct all the same
            out = torch.cat([out.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
        return out

    def keys(self) -> Iterator[str]:
        yield self.key


@dataclass
class Stack:
    """`MergeModulelist(dim)`: the parts (one per expert) stacked along a new `dim`."""

    parts: list[Any]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape
        return (*inner[:self.dim], len(self.parts), *inner[self.dim:])

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        ranges = box.get(self.dim, [(0, len(self.parts))])
        inner = {d - (d > self.dim): r for d, r in box.items() if d != self.dim}
        picked = [self.parts[i] for a, b in ranges for i in range(a, b)]  # only these experts are read
        out = None
        for i, part in enumerate(picked):  # into the stack as read: the peak is the stack plus one expert's slice
            t = part.read(reader, inner, **kwargs)
            out = t.new_empty((*t.shape[:self.dim], len(picked), *t.shape[self.dim:])) if out is None else out
            out.select(self.dim, i).copy_(t)
        return out

    def keys(self) -> Iterator[str]:
        for p in self.parts:
            yield from p.keys()


@dataclass
class Cat:
    """`Concatenate(dim)`: the parts side by side along `dim`."""

    parts: list[Any]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        bounds, start = [], 0
        for part in self.parts:
            bounds.append((start, start + part.shape[self.dim]))
            start += part.shape[self.dim]
        out, offset = None, 0
        for a, b in box.get(self.dim, [(0, start)]):  # each wanted range, in order, cut at the parts' borders
            for part, (lo, hi) in zip(self.parts, bounds):
                if max(a, lo) < min(b, hi):
                    t = part.read(reader, {**box, self.dim: [(max(a, lo) - lo, min(b, hi) - lo)]}, **kwargs)
                    out = t.new_empty(_box_shape(self.shape, box)) if out is None else out
                    out.narrow(self.dim, offset, t.shape[self.dim]).copy_(t)  # peak: the result plus one piece
                    offset += t.shape[self.dim]
        return out

    def keys(self) -> Iterator[str]:
        for p in self.parts:
            yield from p.keys()


@dataclass
class Part:
    """`Chunk(dim)`: chunk `index` of `count` equal chunks of `whole` along `dim`."""

    whole: Any
    dim: int
    index: int
    count: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.whole.shape)
        shape[self.dim] //= self.count
        return tuple(shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        size = self.shape[self.dim]
        offset = self.index * size
        ranges = [(a + offset, b + offset) for a, b in box.get(self.dim, [(0, size)])]
        return self.whole.read(reader, {**box, self.dim: ranges}, **kwargs)

    def keys(self) -> Iterator[str]:
        yield from self.whole.keys()


class RowPermutation:
    """A permutation of `whole`'s rows along `dim`: row t of the result is row `source(t)` of `whole`. A wanted range
    reads the rows it comes from (as few ranges as they make), then puts them in order. Subclasses are dataclasses
    with `whole` and `dim`."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.whole.shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        rows = [self.source(t) for a, b in box.get(self.dim, [(0, self.shape[self.dim])]) for t in range(a, b)]
        wanted = sorted(set(rows))  # read as runs of consecutive rows
        ranges = list(zip([r for i, r in enumerate(wanted) if i == 0 or wanted[i - 1] != r - 1],
                          [r + 1 for i, r in enumerate(wanted) if i + 1 == len(wanted) or wanted[i + 1] != r + 1]))
        out = self.whole.read(reader, {**box, self.dim: ranges}, **kwargs)
        if rows == wanted:
            return out
        at = {r: i for i, r in enumerate(wanted)}
        return out.index_select(self.dim, torch.tensor([at[r] for r in rows], device=out.device))

    def keys(self) -> Iterator[str]:
        yield from self.whole.keys()


@dataclass
class Interleaved(RowPermutation):
    """`Interleave(dim)`: `whole`'s rows along `dim` de-interleaved (its even rows first, then its odd ones;
    `inverse`: the first half's rows and the second's alternately)."""

    whole: Any
    dim: int
    inverse: bool

    def source(self, row: int) -> int:
        half = self.shape[self.dim] // 2
        return (row % 2) * half + row // 2 if self.inverse else (row % half) * 2 + row // half


@dataclass
class RopePermuted(RowPermutation):
    """`PermuteForRope`: within each of `heads` heads along dim 0, rows in interleaved rotary pairs put in the
    rotate-half order (each pair's first elements, then its second ones; `inverse`: back)."""

    whole: Any
    heads: int
    inverse: bool
    dim: int = 0

    def source(self, row: int) -> int:
        size = self.shape[0] // self.heads
        head, r = divmod(row, size)
        if self.inverse:
            i, j = divmod(r, 2)
            return head * size + j * (size // 2) + i
        j, i = divmod(r, size // 2)
        return head * size + 2 * i + j


@dataclass
class Transposed:
    """`Transpose(dim0, dim1)`: `whole` with two dims swapped."""

    whole: Any
    dim0: int
    dim1: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.whole.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        return tuple(shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        swap = {self.dim0: self.dim1, self.dim1: self.dim0}
        out = self.whole.read(reader, {swap.get(d, d): r for d, r in box.items()}, **kwargs)
        return out.transpose(self.dim0, self.dim1).contiguous()

    def keys(self) -> Iterator[str]:
        yield from self.whole.keys()


@dataclass
class Converted:
    """A parameter that a transformers rule builds from checkpoint tensors: `node`'s tree, read slice by slice."""

    rule: str
    node: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.node.shape)

    def keys(self) -> list[str]:
        """The checkpoint tensors it is built from."""
        return list(self.node.keys())

    def read(self, reader, spec: ShardSpec, *, tp_size: int, tp_rank: int, ep_size: int = 1, ep_rank: int = 0,
             dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """This rank's piece (its experts over ep, then its TP chunk), reading only its bytes."""
        return self.node.read(reader, local_box(spec, self.shape, tp_size, tp_rank, ep_size, ep_rank),
                              dtype=dtype, device=device)


def _box_shape(shape: tuple[int, ...], box: Box) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in box[d]) if d in box else n for d, n in enumerate(shape))


def local_box(spec: ShardSpec, shape: tuple[int, ...], tp_size: int, tp_rank: int, ep_size: int,
              ep_rank: int) -> Box:
    """The global ranges, per dim, of the piece of a tensor of `shape` that `spec` gives this rank (in local order)."""
    box: Box = {}
    offset = 0
    if spec.ep_split:
        per_rank = shape[0] // ep_size
        offset = ep_rank * per_rank
        shape = (per_rank, *shape[1:])
        box[0] = [(offset, offset + per_rank)]
    if spec.dim is not None and tp_size > 1:
        ranges = spec.local_ranges(shape, tp_size, tp_rank)
        box[spec.dim] = [(a + offset, b + offset) for a, b in ranges] if spec.dim == 0 else ranges
    return box
