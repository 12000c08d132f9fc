"""A training step's time on a device profile: its FLOPs, its memory traffic and what each mesh axis moves.

    estimate = step_time(shapes, ParallelDims(tp=2, dp_shard=4), settings, device_profile("h100"))
    estimate.seconds, estimate.comm_bytes            # {"tp": bytes one rank sends per step, ...}

Compute: 6 x tokens x (linear parameters) FLOPs for forward and backward (Kaplan et al. 2020; 4 x with frozen
weights, the backward of the inputs only), causal attention's 2 x 2 x s^2 x heads x head_dim / 2 in forward and twice
that in backward (FlashAttention's count), a vision-language model's tower the same way on each image's tokens (its
attention not causal), activation checkpointing's second forward; at the profile's peak times
its efficiency, the bf16 rate under --bf16. Memory traffic: the saved activations written and read, and AdamW's pass
over parameters, gradients and states, at the memory bandwidth. Communication, each rank's bytes per step (the
payload of each collective, as `CommTracker` records it), timed as ring collectives over the axis's link (NVLink
inside a node, the network across: the axes are laid out tp innermost, then cp, dp_shard, dp_replicate, pp):
TP's two all-reduces per layer in forward and two in backward (Megatron), CP's K/V all-gather and reduce-scatter
per attention layer, FSDP2's all-gathers and reduce-scatters per step, dp_replicate's all-reduce, EP's four
all-to-alls per MoE layer, the pipeline's sends of hidden states. TP, CP, EP and the pipeline's sends wait on the
critical path; FSDP2's and dp_replicate's hide behind compute on a GPU (CUDA streams), not on a CPU. A pipeline
adds its bubble: (pp - 1) microbatch slots per step, (pp - 1) / 2 for the interleaved and V schedules.
"""
from __future__ import annotations

from dataclasses import dataclass

from tptrain.diagnostics.device_profiles import DeviceProfile
from tptrain.diagnostics.train_settings import TrainSettings
from tptrain.layout import ParallelDims
from tptrain.diagnostics.model_shapes import LayerShape, ModelShapes, TowerShape
from tptrain.parallel import pipeline_parallel

LINK_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")  # innermost first: ranks of one tp group are neighbours


@dataclass
class StepTime:
    """seconds: one optimizer step; tokens_per_s: the step's tokens over all dp ranks per second; comm_bytes: {axis:
    bytes one rank sends per step}; parts: {compute, memory, exposed communication, pipeline bubble, optimizer}."""

    seconds: float
    tokens_per_s: float
    comm_bytes: dict[str, int]
    parts: dict[str, float]


def _layer_flops(shape: LayerShape, tokens: int, seq_keys: int, batch_queries: int, tp: int, expert_parallel: bool
                 ) -> tuple[float, float]:
    """(matmul FLOPs of one forward of the layer's linear layers, of its attention) on one TP rank."""
    h, heads = shape.hidden, max(1, shape.heads // tp)
    kv = max(1, shape.kv_heads // tp)
    attn_params = h * (heads * shape.q_dim + kv * (shape.q_dim + shape.v_dim)) + heads * shape.v_dim * h  # q/k/v, o
    linear = 2 * tokens * attn_params
    if shape.moe is None:
        linear += 2 * tokens * 3 * h * (shape.mlp_inner // tp)
    else:
        moe = shape.moe
        rows = tokens * moe.top_k // tp if expert_parallel and tp > 1 else tokens * moe.top_k
        inner = moe.inner if expert_parallel and tp > 1 else moe.inner // tp
        linear += 2 * rows * 3 * h * inner + 2 * tokens * h * moe.experts
        linear += 2 * tokens * 3 * h * (moe.shared_inner // tp)
    # q.k and p.v for each query against the keys before it (half the sequence on average: causal)
    attention = 2 * batch_queries * (seq_keys / 2) * heads * (shape.q_dim + shape.v_dim)
    return linear, attention


def _tower_flops(tower: TowerShape, images: int, tokens: int, tp: int) -> tuple[float, float]:
    """(matmul FLOPs of one forward of a vision tower's layers, of their attention) for `images` of `tokens` each on
    one TP rank (its layers split over `tp`, 1: whole); every token attends to its whole image."""
    width = tower.heads // tp * tower.head_dim
    per_token = tower.hidden * 4 * width + (3 if tower.act_tensors == 4 else 2) * tower.hidden * (tower.inner // tp)
    linear = 2 * images * tokens * per_token * tower.depth
    attention = 2 * images * tokens * tokens * 2 * width * tower.depth
    return linear, attention


def _link(axis: str, layout: ParallelDims, profile: DeviceProfile) -> float:
    """The bandwidth one rank of an `axis` group sends at: NVLink when the group fits in one node."""
    stride = 1
    for inner in LINK_ORDER[:LINK_ORDER.index(axis)]:
        stride *= getattr(layout, inner)
    span = stride * getattr(layout, axis)
    return profile.intra_node_bw if span <= profile.devices_per_node else profile.inter_node_bw


def _ring(size: int) -> float:
    """The fraction of an all-gather's (or reduce-scatter's) whole tensor each rank sends on a ring: (p - 1) / p."""
    return (size - 1) / size if size > 1 else 0.0


def comm_bytes(shapes: ModelShapes, layout: ParallelDims, settings: TrainSettings, gathered: int, grads: int
               ) -> tuple[dict[str, int], dict[str, list[tuple[str, float]]]]:
    """({axis: bytes one rank sends per step}, {axis: [(collective, bytes it puts on the wire, counting the ring's
    factors)]}). `gathered` / `grads`: the rank's parameters as FSDP2 gathers them and its gradients as it reduces
    them."""
    m = settings.microbatches(layout.pp)
    mb, c = settings.batch_size // m, (2 if settings.bf16 else settings.dtype.itemsize)
    tokens = mb * settings.seq_len // layout.cp  # per microbatch, on this rank
    layers = len(shapes.layers) // layout.pp
    h, recompute = shapes.hidden, 1 + settings.gradient_checkpointing
    act = tokens * h * c
    sent: dict[str, float] = {}
    wire: dict[str, list[tuple[str, float]]] = {}
    if layout.tp > 1:  # 2 sums in forward, 2 boundaries in backward per layer; the embedding's sum, the head's boundary
        sent["tp"] = m * act * (layers * 2 * (recompute + 1) + 2)
        wire["tp"] = [("all_reduce", sent["tp"] * 2 * _ring(layout.tp))]
    if layout.cp > 1:
        first = shapes.layers[0]
        kv = max(1, first.kv_heads // layout.tp) * (first.q_dim + first.v_dim)
        gather, scatter = tokens * kv * c, mb * settings.seq_len * kv * c
        sent["cp"] = m * layers * (recompute * gather + scatter)
        wire["cp"] = [("all_gather", m * layers * recompute * gather * (layout.cp - 1)),
                      ("reduce_scatter", m * layers * scatter * _ring(layout.cp))]
    shards = layout.dp_shard_cp
    if layout.data_parallel and shards > 1:
        gathers = 1 if layout.pp > 1 else 2  # forward and again before backward; a pipeline keeps its stage gathered
        sent["dp_shard"] = gathers * gathered // shards + grads
        wire["dp_shard"] = [("all_gather", gathers * gathered * _ring(shards)), ("reduce_scatter", grads * _ring(shards))]
    if layout.dp_replicate > 1:
        sent["dp_replicate"] = grads // shards
        wire["dp_replicate"] = [("all_reduce", sent["dp_replicate"] * 2 * _ring(layout.dp_replicate))]
    moe_layers = sum(layer.moe is not None for layer in shapes.layers) // layout.pp
    if layout.ep > 1 and moe_layers:  # rows out and results back, in forward (twice with recompute) and backward
        rows = tokens * shapes.layers[-1].moe.top_k * h * c
        sent["ep"] = m * moe_layers * rows * 2 * (1 + recompute)
        wire["ep"] = [("all_to_all", sent["ep"] * _ring(layout.ep))]
    if layout.pp > 1:
        sent["pp"] = 2 * m * act  # each microbatch's hidden states forward, their gradient backward
        wire["pp"] = [("send", sent["pp"])]
    return {axis: int(v) for axis, v in sent.items()}, wire


def step_time(shapes: ModelShapes, layout: ParallelDims, settings: TrainSettings, profile: DeviceProfile, *,
              gathered: int, grads: int, optimizer_bytes: int, activation_bytes: int) -> StepTime:
    """One step's time on the slowest pp rank (see the module doc). The byte counts come from the memory plan:
    `gathered` / `grads` the rank's parameters and gradients as FSDP2 moves them, `optimizer_bytes` what AdamW reads
    and writes, `activation_bytes` what one microbatch saves for backward."""
    m = settings.microbatches(layout.pp)
    mb = settings.batch_size // m
    tokens = mb * settings.seq_len // layout.cp
    layers = shapes.layers[: max(1, len(shapes.layers) // layout.pp)]
    linear = attention = 0.0
    for shape in layers:
        lin, att = _layer_flops(shape, tokens, settings.seq_len, mb * settings.seq_len // layout.cp, layout.tp,
                                settings.expert_parallel)
        linear, attention = linear + lin, attention + att
    if shapes.tower is not None and settings.images_per_sample:  # on the first stage, the slowest's bound
        lin, att = _tower_flops(shapes.tower, mb * settings.images_per_sample,
                                shapes.tower.tokens(settings.image_size), shapes.tower_tp(layout.tp, layout.ep))
        linear, attention = linear + lin, attention + att
    head = 2 * tokens * shapes.hidden * shapes.vocab / layout.tp if layout.pp == 1 else 0.0
    frozen = settings.lora_r > 0
    passes = (1 + (1 if frozen else 2)) + settings.gradient_checkpointing  # forward, backward, recompute
    reference = settings.reference in ("copy", "adapters")  # a preference run's reference: one more forward
    flops = linear * (passes + reference) + attention * (3 + settings.gradient_checkpointing + reference) \
        + head * (3 + reference)
    world_on_node = min(layout.world_size, profile.devices_per_node)
    rate = profile.flops(settings.bf16 or settings.dtype.itemsize == 2) * profile.efficiency
    rate *= profile.compute_share(world_on_node)
    compute = flops / rate
    bw = profile.memory_bw * profile.efficiency * profile.compute_share(world_on_node)
    memory = 3 * activation_bytes / bw
    sent, wire = comm_bytes(shapes, layout, settings, gathered, grads)
    timed = {axis: sum(nbytes / (_link(axis if axis != "ep" else "dp_shard", layout, profile) * profile.efficiency
                                 * profile.collective(op)) for op, nbytes in wire[axis]) for axis in wire}
    in_line = sum(t for axis, t in timed.items() if axis in ("tp", "cp", "ep", "pp")) / m
    hidden = sum(t for axis, t in timed.items() if axis in ("dp_shard", "dp_replicate"))
    per_microbatch = compute + memory + in_line
    schedule = pipeline_parallel.schedule_name(settings.pp_schedule) if layout.pp > 1 else "1F1B"
    bubble_slots = 0.0 if layout.pp == 1 else (layout.pp - 1) / (1 if schedule in ("GPipe", "1F1B") else 2)
    busy = per_microbatch * m
    exposed = max(0.0, hidden - busy) if profile.overlaps_comm else hidden
    optimizer = optimizer_bytes / bw
    seconds = busy + per_microbatch * bubble_slots + exposed + optimizer
    global_tokens = layout.dp * settings.batch_size * settings.seq_len
    return StepTime(seconds, global_tokens / seconds, sent,
                    {"compute": compute * m, "memory": memory * m, "communication": in_line * m + exposed,
                     "pipeline_bubble": per_microbatch * bubble_slots, "optimizer": optimizer})
