"""The one decoder-only transformer. Llama, Qwen2/3, Mistral/Ministral/Ministral 3, Granite, SmolLM3, OLMo 2/3,
Gemma 2/3, Phi-3 and the mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3; their
block is in moe.py, DeepSeek's attention in latent_attention.py) differ only by config flags.

    model = LlamaForCausalLM.from_config(LlamaConfig(...))   # the classes per model_type: models/auto.py
    out = model(input_ids, labels=input_ids)        # CausalLMOutput(loss, logits)

Single-device code with Hugging Face parameter names. Under tensor parallelism the same code runs
on sharded q/k/v/o and MLP weights: head counts and widths are read from tensor shapes, never
from the config, and the loss goes through `self.loss_function`, which the TP engine may replace.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tptrain.losses import CausalLMOutput, causal_lm_loss, chunked_causal_lm_loss
from tptrain.modeling import PreTrainedModel
from tptrain.models.cache import KVCache, LayerCache
from tptrain.models.configuration import PretrainedConfig
from tptrain.models.layers import (MLP, Embedding, FusedLinear, HeadGradient, RMSNorm, causal_mask, document_ids,
                                   rms_norm, scaled, sdpa, softcapped_attention, split_fused, tanh_softcap)
from tptrain.models.latent_attention import LatentAttention
from tptrain.models.moe import Experts, GroupLimitedRouter, SparseMoeBlock, balancing_loss, router_statistics
from tptrain.models.rope import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    # What the tensor-parallel engine needs to know, as data: k/v rows are KV heads (replicated when
    # tp_size > num_key_value_heads), and which projections feed which (a split output must meet a split input).
    tp_kv_projections = ("k_proj", "v_proj")
    tp_pairs = {"o_proj": ("q_proj", "k_proj", "v_proj"), "q_norm": ("q_proj",), "k_norm": ("k_proj",)}

    def __init__(self, config: PretrainedConfig, *, use_rope: bool = True) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.head_dim = head_dim
        self.use_rope = use_rope  # False: no positional encoding in this layer (NoPE)
        self.scale = config.attention_scale
        self.softcap = config.attn_softcap  # None: SDPA; else scores are soft-capped (softcapped_attention)
        q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        self.fused = config.fused_projections
        if self.fused:  # one qkv_proj; KV heads are its last two segments
            self.qkv_proj = FusedLinear(hidden, ((q_rows, False), (kv_rows, True), (kv_rows, True)),
                                         bias=config.qkv_bias)
            self.tp_kv_projections, self.tp_pairs = (), {"o_proj": ("qkv_proj",)}
        else:
            self.q_proj = nn.Linear(hidden, q_rows, bias=config.qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_rows, bias=config.qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_rows, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            over_width = config.qk_norm == "width"  # the whole projected width, else each head's head_dim
            self.q_norm = rms_norm(config, q_rows if over_width else head_dim)
            self.k_norm = rms_norm(config, kv_rows if over_width else head_dim)
        if config.qk_norm == "width":  # o_proj reads what the norms made of q and k
            self.tp_pairs = {**self.tp_pairs, "o_proj": ("q_norm", "k_norm", "v_proj")}
        self.qk_norm = config.qk_norm
        self.rope_in_float32 = config.rope_in_float32

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                q_scale: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        if self.fused:
            q, k, v = split_fused(self.qkv_proj, x)  # (batch, seq, local width of each)
            v = v.contiguous()  # attention saves v: a view would keep the whole fused output (q and k too) alive
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (batch, seq, local width)
        if self.qk_norm == "width":
            q, k = self.q_norm(q), self.k_norm(k)
        # Shapes come from the projections, not from x: under TP the heads are this rank's local
        # heads, and under sequence parallelism x is a sequence shard while q spans the full sequence.
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim)  # (batch, seq, local_heads, head_dim)
        k = k.view(b, s, -1, self.head_dim)  # (batch, seq, local_kv_heads, head_dim)
        v = v.view(b, s, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, head_dim)
        if self.use_rope:
            q, k = apply_rotary(q, k, cos, sin, keep_dtype=self.rope_in_float32)
        if q_scale is not None:  # (batch or 1, 1, seq, 1): config.query_position_scale
            q = q * q_scale.to(q.dtype)
        if cache is not None:  # the keys and values of every position so far, this forward's appended
            k, v = cache.update(k, v)
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # (batch, seq, local_heads * head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (batch, heads, queries, head_dim), k and v (batch, kv_heads, keys, head_dim), rotated; mask (batch or
        1, 1, queries, keys), or None: plain causal, the queries at the last `queries` of the keys' positions ->
        (batch, heads, queries, head_dim). The engine may wrap it on the instance (context parallelism gathers every
        rank's keys and values first)."""
        groups = q.shape[1] // k.shape[1]
        assert groups * k.shape[1] == q.shape[1], f"{q.shape[1]} q heads vs {k.shape[1]} kv heads"
        # SDPA's own GQA where its kernels take it (plain causal: as transformers' sdpa picks it), with no expanded
        # copy of k and v (nor its summing backward); else the explicit expansion keeps every backend available.
        native_gqa = groups > 1 and self.softcap is None and mask is None and (
            q.shape[2] == k.shape[2] or q.device.type == "cpu")
        if groups > 1 and not native_gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.softcap is None:
            return sdpa(q, k, v, mask, scale=self.scale, enable_gqa=native_gqa)
        # heads are independent: capping this rank's local heads is the capping of the whole
        return softcapped_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.sliding_window = config.layer_sliding_windows[layer_idx]  # read by DecoderModel for the mask
        self.residual_scale = config.residual_scale
        self.self_attn = LatentAttention(config) if config.latent_attention else Attention(
            config, use_rope=config.layer_uses_rope[layer_idx])
        self.mlp = SparseMoeBlock(config, MLP) if config.layer_is_moe[layer_idx] else MLP(config)
        # transformers' names of (attention input, attention output, MLP input, MLP output) norms; None: no norm there
        names = _sublayer_norm_names(config.norm_sublayer_input, config.norm_sublayer_output)
        self.attn_norms, self.mlp_norms = names[:2], names[2:]
        for name in filter(None, names):
            self.add_module(name, rms_norm(config, config.hidden_size))

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else getattr(self, name)(x)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                q_scale: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        (attn_in, attn_out), (mlp_in, mlp_out) = self.attn_norms, self.mlp_norms
        attn = self.self_attn(self._norm(attn_in, h), cos, sin, mask, q_scale, cache)
        h = h + scaled(self._norm(attn_out, attn), self.residual_scale)
        return h + scaled(self._norm(mlp_out, self.mlp(self._norm(mlp_in, h))), self.residual_scale)


def _sublayer_norm_names(on_input: bool, on_output: bool) -> tuple[str | None, ...]:
    """(attention input, attention output, MLP input, MLP output) norm names as transformers spells them."""
    if on_input and on_output:  # Gemma
        return "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
    if on_output:  # OLMo 2
        return None, "post_attention_layernorm", None, "post_feedforward_layernorm"
    assert on_input, "a decoder layer needs its norms somewhere"
    return "input_layernorm", None, "post_attention_layernorm", None  # Llama


class DecoderModel(nn.Module):
    """The `model.` part: embeddings, decoder layers, final norm. Returns hidden states."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = rms_norm(config, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.embedding_scale = config.embedding_scale
        self.embedding_scale_in_weight_dtype = config.embedding_scale_in_weight_dtype
        self.query_position_scale = config.query_position_scale
        self.gradient_checkpointing = False

    def embed(self, input_ids: torch.Tensor, head_gradient: HeadGradient | None = None) -> torch.Tensor:
        # (batch, seq, hidden); a sequence shard under sequence parallelism, input_ids are the full sequence
        if head_gradient is None:
            h = self.embed_tokens(input_ids)
        else:  # the tied head's gradient meets the embedding's in its backward (layers.HeadGradient)
            self.embed_tokens.head_gradient = head_gradient
            try:
                h = self.embed_tokens(input_ids)
            finally:
                self.embed_tokens.head_gradient = None
        scale = self.embedding_scale
        if self.embedding_scale_in_weight_dtype:  # transformers' Gemma casts sqrt(hidden) to the weights' dtype
            scale = torch.tensor(scale, dtype=h.dtype).item()
        return scaled(h, scale)

    def indexed_layers(self) -> list[tuple[int, nn.Module]]:
        """(layer index in the whole model, layer): a pipeline stage holds some layers only, as a ModuleDict keyed
        by that index, so their parameter names stay the whole model's (`layers.5.mlp...`)."""
        items = self.layers.items() if isinstance(self.layers, nn.ModuleDict) else enumerate(self.layers)
        return [(int(i), layer) for i, layer in items]

    def forward(self, input_ids: torch.Tensor | None = None, *, hidden_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                head_gradient: HeadGradient | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """The token ids, or (a pipeline stage without the embedding) the hidden states of the layers before, run
        through the layers this module holds and the final norm if it holds one. `head_gradient`: where the
        embedding's backward adds its rows into the tied head's gradient (`DecoderForCausalLM.forward`). `cache`:
        the earlier positions' keys and values, which these tokens follow (`attention_mask` then covers both)."""
        h = self.embed(input_ids, head_gradient) if hidden_states is None else hidden_states
        seq, device = (input_ids if hidden_states is None else h).shape[1], h.device
        past = 0 if cache is None else cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=device)[None]
        layer_rope = self.rotary_emb.layer_rope  # per layer: the first layer with the same RoPE
        layers = self.indexed_layers()
        rope = {r: self.rotary_emb(h, position_ids, r) for r in {layer_rope[i] for i, _ in layers}}  # {that: (cos, sin)}
        q_scale = None
        if self.query_position_scale is not None:  # as transformers: fp32 positions, log(1 + .)
            beta, length = self.query_position_scale
            q_scale = (1 + beta * torch.log(1 + torch.floor(position_ids.float() / length)))[:, None, :, None]
        masks = self.attention_masks(position_ids, attention_mask, {layer.sliding_window for _, layer in layers},
                                     past=past)
        for i, layer in layers:
            mask = masks[layer.sliding_window]
            cos, sin = rope[layer_rope[i]]
            if self.gradient_checkpointing and self.training and cache is None:
                h = checkpoint(layer, h, cos, sin, mask, q_scale, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask, q_scale, None if cache is None else cache.layer(i))
        return h if self.norm is None else self.norm(h)

    def attention_masks(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, windows: set, *,
                        past: int = 0, query_index: torch.Tensor | None = None,
                        key_index: torch.Tensor | None = None) -> dict[int | None, torch.Tensor | None]:
        """{sliding window (None: none): its mask} over the sequence of `position_ids` (batch or 1, seq), packed
        samples block-diagonal; `query_index` / `key_index` pick and order its rows / columns (`causal_mask`). The
        engine may wrap it on the instance (context parallelism: the rows of this rank's queries). `past`: the
        positions a KV cache holds before these (the rows are then the last ones, no packed samples)."""
        documents = None if past else document_ids(position_ids)  # packed samples: block-diagonal causal attention
        seq = past + position_ids.shape[-1]
        if past:
            query_index = torch.arange(past, seq, device=position_ids.device)
        return {w: causal_mask(seq, device=position_ids.device, attention_mask=attention_mask, sliding_window=w,
                               documents=documents, query_index=query_index, key_index=key_index) for w in windows}


class DecoderForCausalLM(PreTrainedModel):
    """DecoderModel + lm_head. Each model_type's class (LlamaForCausalLM, ...) is this with its config class, made
    from the registry (models/auto.py)."""

    config_class = PretrainedConfig
    _tp_plan = {"lm_head": "colwise_gather_output"}
    # What a pipeline stage is cut from (parallel/contract.py PipelineModel): the layer list, what only the first
    # stage holds, what only the last one holds.
    pp_layers, pp_first, pp_last = "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head")

    def __init__(self, config: PretrainedConfig) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got "
                            f"{type(config).__name__}; use tptrain.models.AutoModelForCausalLM.")
        super().__init__(config)
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_function = causal_lm_loss  # (logits, labels, num_items_in_batch) -> loss
        # (h, head weight, labels, num_items_in_batch, transform=) -> loss, without the whole logits: training
        # with labels uses it; the TP engine swaps in its vocab-parallel version.
        self.head_loss_function = chunked_causal_lm_loss
        if hasattr(config, "num_experts"):  # the load-balancing loss (output_router_logits), in two steps the
            # parallel engines wrap: the MoE layers' token statistics ((router logits, attention_mask) -> stats), then
            # the loss of the statistics (stats -> this rank's share, the counts summed over the token shards)
            self.router_statistics = partial(router_statistics, num_experts=config.num_experts,
                                             top_k=config.num_experts_per_tok)
            self.router_aux_loss_function = partial(balancing_loss, num_experts=config.num_experts)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Share lm_head.weight with embed_tokens.weight if the config says so.

        Call again after `to_empty()` / materialisation: it replaces parameters one module at a time
        and so unties them.
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' random init: Linear/Embedding ~ N(0, initializer_range), biases 0, norm scales 1.

        Works on whatever tensors the modules hold (full, sharded, or meta, where it is a no-op).
        """
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, RMSNorm):  # scale 1: weight 1, or 0 for an offset of 1
                nn.init.constant_(module.weight, 1.0 - module.weight_offset)
            if isinstance(module, Experts):
                for p in module.parameters(recurse=False):
                    nn.init.normal_(p, mean=0.0, std=std)
            if isinstance(module, GroupLimitedRouter):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.e_score_correction_bias)

    def checkpoint_keys(self) -> dict[str, str | list[str]]:
        """{parameter name: its name in the checkpoint, or the per-expert names a stacked tensor is made of} for
        every parameter not stored under its own name (MoE experts and routers); the loader and save_pretrained
        convert at this boundary only."""
        keys: dict[str, str | list[str]] = {}
        for name, module in self.named_modules():
            if isinstance(module, SparseMoeBlock):
                keys.update(module.checkpoint_keys(name, self.config))
        if self.config.tie_word_embeddings and self.model.embed_tokens is None and self.lm_head is not None:
            keys["lm_head.weight"] = "model.embed_tokens.weight"  # a last pipeline stage: the head IS the embedding
        return {k: v for k, v in keys.items() if v != k}

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each decoder layer in backward (non-reentrant torch.utils.checkpoint)."""
        self.model.gradient_checkpointing = True

    def _transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Element-wise, so vocab-sharded logits (and chunks of them) stay sharded."""
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        return tanh_softcap(logits, self.config.logit_softcap)

    def fuses_head_loss(self) -> bool:
        """Whether a forward with labels (and not `return_logits`) computes the loss with `head_loss_function`:
        in training mode, with a plain nn.Linear head (the fused loss needs its weight; any other head module, a
        LoRA-wrapped one say, computes its logits whole)."""
        return self.training and isinstance(self.lm_head, nn.Linear)

    def _head_gradient_meets_embedding(self) -> bool:
        """Whether the head's weight gradient can take the embedding's rows (`HeadGradient`): the head's weight IS
        the embedding's (tied, both held here), trained, and the embedding is the plain one (not a LoRA wrapper)."""
        embedding = self.model.embed_tokens
        return (isinstance(embedding, Embedding) and self.lm_head.weight is embedding.weight
                and embedding.weight.requires_grad and torch.is_grad_enabled())

    def pipeline_forward(self, x: torch.Tensor, *carried: torch.Tensor,
                         position_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What this module holds of the computation: token ids in if it holds the embedding, else the hidden states
        of the layers before; (batch, seq, vocab) logits out if it holds the head, else hidden states. A pipeline
        stage (parallel/pipeline_parallel.py) removes what it does not hold; the whole model runs it all. With the
        router aux loss, the router statistics of the layers before (`carried`, none on the first stage) plus its
        own ride along: (output, statistics), for the last stage's `pipeline_loss`."""
        if self.model.embed_tokens is not None:
            h = self.model(x, position_ids=position_ids)
        else:
            h = self.model(hidden_states=x, position_ids=position_ids)
        out = h if self.lm_head is None else self._transform_logits(self.lm_head(h))
        if not getattr(self.config, "output_router_logits", False):
            return out
        stats = self.router_statistics(self._router_logits(), None)
        return out, (stats + carried[0] if carried else stats)

    def pipeline_loss(self, loss: torch.Tensor, *carried: torch.Tensor) -> torch.Tensor:
        """A microbatch's loss on the last stage with what the stages carried: the router aux loss of its statistics
        (each microbatch is a forward of its own, as with gradient accumulation)."""
        if not carried:
            return loss
        return loss + self.config.router_aux_loss_coef * self.router_aux_loss_function(carried[0]).to(loss.dtype)

    def _router_logits(self) -> list[torch.Tensor]:
        """The router logits of the last forward of every MoE layer this module holds."""
        return [m.router_logits for m in self.model.layers.modules() if isinstance(m, SparseMoeBlock)]

    def forward(self, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, return_logits: bool = False,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int = 0, per_sequence: bool = False) -> CausalLMOutput:
        """In training mode with labels the loss is computed from the hidden states in chunks of tokens and
        `logits` is None (`return_logits=True` computes them whole instead); otherwise (batch, seq, vocab) logits,
        of the last `logits_to_keep` positions only if given. With `use_cache` (or a cache given: transformers'
        `past_key_values`) the keys and values of these tokens are appended to the cache (a new KVCache if none),
        returned in `past_key_values`; `attention_mask` then covers the cached positions and these. `per_sequence`:
        `loss` is each row's summed token loss (batch,), the router aux loss left out of it."""
        fused = labels is not None and not return_logits and self.fuses_head_loss()
        meeting = HeadGradient() if fused and self._head_gradient_meets_embedding() else None
        cache = past_key_values if past_key_values is not None else KVCache() if use_cache else None
        h = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, head_gradient=meeting,
                       cache=cache)
        if fused:
            logits = None
            weight = self.lm_head.weight if meeting is None else meeting.head_weight(self.lm_head.weight)
            loss = self.head_loss_function(h, weight, labels, num_items_in_batch, transform=self._transform_logits,
                                           per_sequence=per_sequence)
        else:
            logits = self._transform_logits(self.lm_head(h[:, -logits_to_keep:]))  # (batch, seq or kept, vocab)
            loss = None if labels is None else self.loss_function(logits, labels, num_items_in_batch,
                                                                  per_sequence=per_sequence)
        aux_loss = None
        if getattr(self.config, "output_router_logits", False):  # as transformers: the coefficient only in `loss`
            mask = None if attention_mask is None else attention_mask[:, -input_ids.shape[1]:]  # these tokens' own
            aux_loss = self.router_aux_loss_function(self.router_statistics(self._router_logits(), mask))
            if loss is not None and not per_sequence:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.dtype)
            aux_loss = aux_loss.float()  # reported in fp32, as transformers (the loss keeps an fp64 model's fp64)
        return CausalLMOutput(loss=loss, logits=logits, aux_loss=aux_loss, past_key_values=cache)

