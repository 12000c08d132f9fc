"""`model.generate`: transformers' generate (greedy or sampled, one sequence per prompt) on the model as it is laid
out, with a KV cache, on every rank of a TP group.

    ids = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)             # (batch, prompt + new)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=True, temperature=0.8,
                         top_p=0.95, generator=0, return_dict_in_generate=True, output_logprobs=True)
    out.sequences, out.logprobs                                                         # + (batch, new) log-probs

Collective: every rank calls it, each data-parallel rank with its own prompts, every rank of a TP group with the same
ones (checked). Each step is a "model" batch of the new tokens with their positions run inside the model's forward
scope (tptrain/distributed/state.py), asking for the logits vocab-sharded: the next token is chosen from each rank's
slice (sampling.py), the same on every rank of the group. The model keeps its own cache (tptrain's KVCache, or
transformers' for the backend); FSDP2's weights are gathered once for the whole generation (`held_unsharded`). The
model runs in eval mode, without gradients, and is put back as it was.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tptrain.distributed import comm
from tptrain.distributed.state import Batch, ParallelState, state_of
from tptrain.generation.sampling import VocabShard, next_tokens, token_logprobs
from tptrain.generation.settings import GenerationSettings, check_input_ids, prompt_mask, resolve_settings
from tptrain.generation.stopping import StopCriteria
from tptrain.layout import Case, Features, check
from tptrain.parallel.context_parallel import gather_sequence
from tptrain.parallel.data_parallel import held_unsharded

LAYOUT_ROWS = ("generate_pp", "generate_cp", "generate_sp")  # the rule table's rows a generation asks


@dataclass
class GenerateDecoderOnlyOutput:
    """With `return_dict_in_generate=True` (transformers' name and field for the ids). `logprobs` (batch, new tokens)
    fp32, with `output_logprobs=True`: each generated token's log-probability under the model at the temperature
    (log_softmax(logits / temperature), before top-k / top-p / min-p: what TRL's GRPO computes from the training
    forward), 0 on the padding after a finished sequence."""

    sequences: torch.Tensor
    logprobs: torch.Tensor | None = None


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, max_length: int | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             stop_strings: str | list[str] | None = None, tokenizer: Any = None,
             generator: torch.Generator | int | None = None, num_return_sequences: int = 1,
             use_cache: bool = True, output_logprobs: bool = False, return_dict_in_generate: bool = False):
    """transformers' `generate` for decoder-only prompts (left-padded, with their attention_mask): the prompts and
    their continuations, (batch x num_return_sequences, prompt + new) ids, padded with pad_token_id after a finished
    sequence, as long as the longest continuation. Arguments as transformers spells them; one not given takes the
    checkpoint's generation_config.json, then transformers' default (settings.py). `generator`: a torch.Generator or
    a seed for the draws, the same on every rank of a TP group (None: a seed from torch's global generator on the
    group's first rank). `use_cache=False` recomputes the whole sequence at every step (what sequence and context
    parallelism can run; the rule table refuses them the cache)."""
    state = state_of(model)
    check_layout(state, use_cache=use_cache)  # before anything: the same refusal on every rank
    given = dict(max_new_tokens=max_new_tokens, max_length=max_length, do_sample=do_sample, temperature=temperature,
                 top_k=top_k, top_p=top_p, min_p=min_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                 stop_strings=stop_strings)
    settings, mask, error = None, None, None
    try:
        check_input_ids(input_ids)
        if output_logprobs and not return_dict_in_generate:
            raise ValueError("generate: output_logprobs=True returns them in GenerateDecoderOnlyOutput.logprobs: pass "
                             "return_dict_in_generate=True as well")
        if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
            raise ValueError(f"generate: num_return_sequences must be a positive integer, got {num_return_sequences}")
        settings = resolve_settings(model, input_ids.shape[1], given, tokenizer=tokenizer)
        mask = prompt_mask(input_ids, attention_mask, settings.pad_token_id)
    except (TypeError, ValueError) as exc:  # raised on every rank, below
        error = exc
    generator = _agree(state, error, (input_ids, attention_mask, settings, num_return_sequences), generator,
                       sampling=settings is not None and settings.do_sample)
    ids = input_ids.repeat_interleave(num_return_sequences, 0)
    mask = None if mask is None else mask.repeat_interleave(num_return_sequences, 0)
    with _evaluating(model), held_unsharded(model):
        sequences, logprobs = _run(model, state, settings, ids, mask, generator, tokenizer, use_cache,
                                   output_logprobs)
    if return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, logprobs=logprobs)
    return sequences


def check_layout(state: ParallelState, *, use_cache: bool = True) -> None:
    """ValueError (the rule table's message) when the model, as laid out, cannot generate (pipeline stages), or not
    with a KV cache (context or sequence parallelism)."""
    case = Case(dims=state.dims, features=Features(sequence_parallel=state.sequence_parallel,
                                                   generation="cache" if use_cache else "recompute"))
    for row in LAYOUT_ROWS:
        check(row, case)


def layout_refusal(model: nn.Module, *, use_cache: bool = True) -> str | None:
    """Why `model`, as laid out, cannot generate (with a KV cache, or at all: `use_cache=False`), or None."""
    try:
        check_layout(state_of(model), use_cache=use_cache)
    except ValueError as exc:
        return str(exc)
    return None


def _agree(state: ParallelState, error: Exception | None, inputs: tuple, generator: torch.Generator | int | None, *,
           sampling: bool) -> torch.Generator | None:
    """Every rank's error raised on every rank (of a laid-out model's job); the TP group's prompts, settings and
    generator compared; the draws' generator (with none given, seeded by the group's first rank)."""
    proposed = None
    if generator is None and sampling:
        proposed = int(torch.randint(2**62, (), dtype=torch.long))  # torch's global generator, on each rank
    digest = None if error is not None else _digest(*inputs, generator)
    if state.dims.tp > 1 and state.tp is not None:
        seen = comm.all_gather_object((digest, proposed), state.tp.ctx.group)
        digests = {d for d, _ in seen}
        if None not in digests and len(digests) > 1:
            error = ValueError("generate: the ranks of a TP group were given different prompts, arguments or "
                               "generator seeds; every rank of a TP group must pass the same input_ids, "
                               "attention_mask, arguments and generator (data-parallel ranks may differ)")
        proposed = seen[0][1]
    if state.mesh is not None:  # laid out: every rank is in this call
        comm.raise_on_any_rank(error)
    elif error is not None:  # a model nobody laid out runs alone
        raise error
    if isinstance(generator, torch.Generator):
        return generator
    seed = generator if generator is not None else proposed
    return None if seed is None else torch.Generator().manual_seed(seed)


def _digest(input_ids, attention_mask, settings, copies, generator) -> str:
    h = hashlib.sha256(repr((settings, copies, tuple(input_ids.shape))).encode())
    for t in (input_ids, attention_mask, generator.get_state() if isinstance(generator, torch.Generator) else None):
        if t is not None:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    h.update(repr(generator if isinstance(generator, int) else None).encode())
    return h.hexdigest()


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class _Steps:
    """The model run one step at a time inside its forward scope: each step's logits of the last position, fp32 (as
    transformers' generate reads them), this rank's slice of the vocabulary. With the cache (the model's own) a step
    runs the tokens it has not seen; without it, the whole sequence so far, right-padded to a length that splits
    under sequence or context parallelism (no real token sees the padding), its logits gathered over cp."""

    def __init__(self, model: nn.Module, state: ParallelState, use_cache: bool) -> None:
        self.model, self.scope, self.cp, self.use_cache = model, state.scope, state.cp, use_cache
        sp = state.dims.tp if state.sequence_parallel else 1
        self.multiple = 1 if use_cache else math.lcm(sp * state.dims.cp, 2 * state.dims.cp if state.cp else 1)
        self.cache, self.seen = None, 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        ids, positions = ids[:, self.seen:], positions[:, self.seen:]
        length, extra = ids.shape[1], -ids.shape[1] % self.multiple
        if extra:
            ids = F.pad(ids, (0, extra))
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1, device=ids.device)], -1)
            mask = None if mask is None else F.pad(mask, (0, extra), value=1)
        batch = Batch("model", input_ids=ids, attention_mask=mask, position_ids=positions, sampled=True)
        out = self.scope.run(batch, self._forward)
        self.cache, self.seen = out.past_key_values, self.seen + length if self.use_cache else 0
        logits = out.logits if self.cp is None else gather_sequence(out.logits, self.cp)
        return logits[:, -1 - extra].float()  # the last real position's: (batch, local vocab)

    def _forward(self, b: Batch):
        return self.model(b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                          past_key_values=self.cache, use_cache=self.use_cache,
                          logits_to_keep=1 if self.multiple == 1 else 0)  # a sequence shard's last is not the last


def _run(model: nn.Module, state: ParallelState, settings: GenerationSettings, ids: torch.Tensor,
         mask: torch.Tensor | None, generator: torch.Generator | None, tokenizer: Any, use_cache: bool,
         output_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loop: the prompts, then one token per sequence per step, until every sequence is finished or has
    max_new_tokens (over an ep axis, whose ranks exchange tokens in every forward, until every rank is done: a rank
    done steps on padding, which it then drops)."""
    device = next(model.parameters()).device
    ids, mask = ids.to(device), None if mask is None else mask.to(device)
    batch, prompt = ids.shape
    shard, lockstep, steps = VocabShard.of(state), _lockstep_group(state), _Steps(model, state, use_cache)
    stop = StopCriteria(settings.eos_token_ids, settings.stop_strings, tokenizer, device)
    rows = None  # with stop strings: each row's real tokens, to spell them
    if settings.stop_strings:
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)] if mask is not None else ids.tolist()
    # As transformers: a finished sequence is padded only when an eos token can finish one (stop strings alone
    # leave it running to the longest one's end)
    pads = bool(settings.eos_token_ids)
    fill = settings.pad_token_id if pads else 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1) if mask is not None else torch.arange(
        prompt, device=device).expand(batch, -1)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    logprobs, produced = [], 0
    while comm.any_rank(unfinished.any(), lockstep, phase="generate") if lockstep is not None else unfinished.any():
        logits = steps(ids, mask, positions)
        token = torch.full_like(unfinished, fill, dtype=torch.long)  # a rank done: a step for the exchanges only
        if unfinished.any():
            uniforms = None if not settings.do_sample else torch.rand(
                batch, generator=generator, device=generator.device, dtype=torch.float64).to(device)
            token = next_tokens(logits, settings, shard, uniforms)
            token = torch.where(unfinished, token, fill) if pads else token
            if output_logprobs:
                logprobs.append(token_logprobs(logits, token, settings.temperature, shard) * unfinished)
            for row, t in zip(rows or (), token.tolist()):
                row.append(t)
            unfinished &= ~stop.finished(token, rows)
            produced += 1
            if produced == settings.max_new_tokens:
                unfinished[:] = False
        ids = torch.cat([ids, token[:, None]], -1)
        advance = 1 if prompt + produced == ids.shape[1] else 0  # a step for the exchanges only: the same position
        positions = torch.cat([positions, positions[:, -1:] + advance], -1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
    return ids[:, :prompt + produced], torch.stack(logprobs, -1) if output_logprobs else None


def _lockstep_group(state: ParallelState):
    """The group whose forwards exchange tokens between data-parallel ranks (experts split over an ep axis), which
    then step together; None otherwise (each data-parallel rank runs alone)."""
    ctx = state.tp.ctx if state.tp is not None else None
    return ctx.ep_group if ctx is not None and ctx.ep_size > 1 else None
