"""PeftModel: a (tensor-parallel or single-device) model with LoRA adapters, saved and loaded in the PEFT format.

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    ...train...
    model.save_pretrained("adapter/")                     # collective; global rank 0 writes, atomically
    model = PeftModel.from_pretrained(base, "adapter/")   # onto a base of any tp_size, or one device
    merged = model.merge_and_unload()                     # a plain TP model; merged.save_pretrained(...)

Structure and parameter names are peft's (`base_model.model.<HF name>`), so the on-disk keys are the
in-memory names without the adapter name. The base is frozen: only adapter factors (plus the biases /
modules_to_save the config asks for) require grad, so optimizers built from `requires_grad` parameters
hold no state for base weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm, raise_on_any_rank
from tptrain.distributed.state import state_of
from tptrain.parallel.saving import gather_parameters, is_sharded, save_once
from tptrain.parallel.pipeline_checkpoint import gather_stages
from tptrain.parallel.pipeline_parallel import held_elsewhere
from tptrain.parallel.styles import ShardSpec
from tptrain.peft import io
from tptrain.peft.config import (ALL_LINEAR, LoraConfig, modules_to_save, resolve_parameter_targets, resolve_targets,
                                 rewrite_expert_targets)
from tptrain.peft.lora import LoraEmbedding, LoraLayer, LoraLinear, LoraRuntime, factor_specs
from tptrain.peft.lora_experts import FUSED, STACKED, LoraExperts, LoraFusedExperts, fused_factor_specs, is_fused_experts
from tptrain.peft.lora_experts import factor_specs as expert_factor_specs


class LoraModel(nn.Module):
    """peft's tuner level: holds the adapted model as `.model`, so parameter names read `base_model.model.…`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class PeftModel(nn.Module):
    """LoRA adapters injected into `model` (in place). Attribute lookups fall through to the base model
    (`config`, `parallel`, `tp_size`, `gradient_checkpointing_enable`, ...)."""

    def __init__(self, model: nn.Module, config: LoraConfig, *, trainable: bool = True,
                 seed: int | None = None) -> None:
        super().__init__()
        if isinstance(model, PeftModel):
            raise TypeError("the model already has LoRA adapters (it is a PeftModel); merge_and_unload() it first, "
                            "or load the adapter onto the plain base model")
        # Pure checks first: identical errors on every rank (a pipeline stage's agreed with the others' first).
        resolve = _resolve_stage if state_of(model).pp is not None else _resolve
        config, targets, experts, weights, full_modules, factors = resolve(model, config)
        targets = {**targets, **weights}  # an nn.Linear's weight as a parameter target: peft's LoRA on it is Linear's
        if config.base_model_name_or_path is None:
            config = dataclasses.replace(config, base_model_name_or_path=getattr(model, "name_or_path", None))
        layout = state_of(model).tp

        self.base_model = LoraModel(model)
        self.peft_config = {"default": config}
        self.runtime = LoraRuntime(seed=_agree_seed(model, layout) if seed is None else seed)
        self._requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        for p in model.parameters():
            p.requires_grad_(False)
        self.lora_layers: dict[str, LoraLayer | LoraExperts] = {}
        for name, module in targets.items():
            key = f"{name}.weight" if name in weights else name  # the name peft's rank_pattern sees
            self.lora_layers[name] = _wrap(model, name, module, config, factors[name], layout, self.runtime, key)
        for name, fused in experts.items():
            self.lora_layers[name] = _wrap_experts(model, name, fused, config, layout, self.runtime)
        self._saved = _trainable_extras(model, config, targets, full_modules)
        self._saved += [n for n, p in model.named_parameters() if _is_lora(n)]
        self.set_trainable(trainable)
        self._step_hook = model.register_forward_pre_hook(lambda m, args: self.count_forward())

    def count_forward(self) -> None:
        """Advance the dropout masks' forward count: before each forward of the model, or under pipeline
        parallelism (where the model's forward never runs) of each stage."""
        self.runtime.step += 1

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model.model, name)

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def get_base_model(self) -> nn.Module:
        return self.base_model.model

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run the base model within the block: every adapter adds nothing (peft's `disable_adapter`). A preference
        objective's reference model is the base, so a LoRA run holds no second copy."""
        enabled, self.runtime.enabled = self.runtime.enabled, False
        try:
            yield
        finally:
            self.runtime.enabled = enabled

    def set_trainable(self, trainable: bool) -> None:
        """Adapter factors (and the config's biases / modules_to_save) require grad iff `trainable`."""
        params = dict(self.get_base_model().named_parameters(remove_duplicate=False))
        for name in self._saved:
            params[name].requires_grad_(trainable)
        state = state_of(self.get_base_model())
        if state.grad_sync is not None:
            state.grad_sync.attach(self.get_base_model())

    def print_trainable_parameters(self) -> None:
        model = self.get_base_model()
        layout = state_of(model).tp
        numel = {n: math.prod(layout.global_shapes[n] if layout else p.shape) for n, p in model.named_parameters()}
        trainable = sum(numel[n] for n, p in model.named_parameters() if p.requires_grad)
        total = sum(numel.values())
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}")

    # ---------------------------------------------------------------- saving / loading

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The adapter under peft's keys, gathered to full shape on the CPU. Collective over the TP group (and,
        cut into pipeline stages, the pp group: every stage's tensors); the dict on TP rank 0 (of global rank 0's
        pp ranks under pp), None elsewhere."""
        model = self.get_base_model()
        state = gather_parameters(model, self._saved)
        if state is not None:
            out = {}
            for name, layer in self._expert_layers().items():  # stacked factors -> peft's fused, flattened tensors
                full = {n[len(name) + 1:]: state.pop(n) for n in list(state) if n.startswith(f"{name}.lora_")}
                out.update({f"{io.PREFIX}{name}.{key}": t for key, t in layer.to_disk(full).items()})
            state = {**{io.disk_key(name): t for name, t in state.items()}, **out}
        if state_of(model).pp is not None:
            state = gather_stages(model, state)
        return state

    def save_pretrained(self, save_directory: str | os.PathLike, **_ignored) -> None:
        """Write adapter_config.json + adapter_model.safetensors (full tensors, whatever tp_size is).
        Collective: every rank calls it; global rank 0 writes atomically; a failure is raised on every rank."""
        model = self.get_base_model()
        config = self.peft_config["default"]
        if state_of(model).pp is not None and isinstance(config.target_modules, list):
            # "all-linear" became this stage's module names: the file's config names every stage's
            names = comm.all_gather_object(config.target_modules, state_of(model).mesh["pp"].get_group())
            if any(n != config.target_modules for n in names):
                config = dataclasses.replace(config, target_modules=sorted(set().union(*names)))
        save_once(save_directory, collective=is_sharded(model), gather=self.adapter_state_dict,
                  write=lambda state: io.write_adapter(save_directory, state, config))

    @classmethod
    def from_pretrained(cls, model: nn.Module, model_id: str | os.PathLike, *,
                        is_trainable: bool = False) -> "PeftModel":
        """Load a peft/tptrain LoRA adapter directory onto `model` (TP of any tp_size, or single-device).
        Each rank reads only its slice. `is_trainable=False` (peft's default) freezes the adapter too."""
        config = LoraConfig.from_pretrained(model_id)
        config.inference_mode = not is_trainable
        # The init is overwritten by the file: a fixed seed avoids a collective before the file is checked.
        peft = cls(model, config, trainable=is_trainable, seed=0)
        try:
            peft.load_adapter_weights(model_id)
        except Exception:
            peft.unload()
            raise
        layout = state_of(model).tp
        peft.runtime.seed = _agree_seed(model, layout)  # for dropout masks when training on
        if not is_trainable:
            peft.eval()
        return peft

    def load_adapter_weights(self, directory: str | os.PathLike) -> None:
        """Overwrite this adapter's tensors (and saved base tensors) with a saved adapter's, sliced per layout.
        Every check happens before any tensor is read, identically on every rank."""
        model = self.get_base_model()
        layout = state_of(model).tp
        params = dict(model.named_parameters(remove_duplicate=False))
        shapes = layout.global_shapes if layout else {n: tuple(p.shape) for n, p in params.items()}
        experts = self._expert_layers()
        in_experts = [n for n in self._saved if any(n.startswith(f"{e}.lora_") for e in experts)]
        expected = {io.disk_key(n): n for n in self._saved if _is_lora(n) and n not in in_experts}
        shapes = dict(shapes)
        for name, layer in experts.items():  # peft's fused tensors: checked under their own keys and shapes
            for key, shape in layer.disk_shapes().items():
                expected[f"{io.PREFIX}{name}.{key}"] = f"{io.PREFIX}{name}.{key}"
                shapes[f"{io.PREFIX}{name}.{key}"] = shape
        extra = {io.PREFIX + n: n for n in params if not _is_lora(n)}
        with io.open_adapter(directory) as reader:
            keys = io.check_adapter_file(reader, expected, extra, shapes,
                                         elsewhere=lambda name: held_elsewhere(model, name))
            plain = {k: n for k, n in keys.items() if n in params}
            io.read_slices(reader, plain, params, layout.specs if layout else {},
                           layout.ctx.size if layout else 1, layout.ctx.rank if layout else 0)
            for name, layer in experts.items():  # whole (adapters are small), converted, then this rank's slice
                prefix = f"{io.PREFIX}{name}."
                tensors = {key: reader.read(prefix + key) for key in layer.disk_shapes()}
                layer.load_full(layer.from_disk(tensors))

    def _expert_layers(self) -> dict[str, LoraExperts]:
        return {n: layer for n, layer in self.lora_layers.items() if isinstance(layer, LoraExperts)}

    # ---------------------------------------------------------------- merging

    def merge_and_unload(self) -> nn.Module:
        """Fold every adapter into its base shard (each rank its own block of s * B @ A) and return the plain
        model (TP layout intact, original requires_grad restored): its save_pretrained writes a merged HF
        checkpoint."""
        return self._unload(merge=True)

    def unload(self) -> nn.Module:
        """Remove the adapters without merging; return the plain base model."""
        return self._unload(merge=False)

    def _unload(self, *, merge: bool) -> nn.Module:
        model = self.get_base_model()
        state = state_of(model)
        layout = state.tp
        for name, layer in self.lora_layers.items():
            base = layer.merge() if merge else layer.unhook()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, base)
            if layout is not None:
                layout.drop(f"{name}.lora_")
                layout.rename(f"{name}.base_layer.", f"{name}.")
        self.lora_layers = {}
        self._step_hook.remove()
        for p, flag in self._requires_grad:
            p.requires_grad_(flag)
        if state.grad_sync is not None:
            state.grad_sync.attach(model)
        return model


def get_peft_model(model: nn.Module, config: LoraConfig) -> PeftModel:
    """Inject fresh LoRA adapters (peft's init: A uniform, B zero; embedding A zero, B normal) into `model`.
    Collective under TP (one all-reduce agreeing on the init seed)."""
    return PeftModel(model, config)


# -------------------------------------------------------------------- helpers


def _resolve(model: nn.Module, config: LoraConfig, *, part: bool = False):
    """(config as saved, {module: module} of target_modules, {experts module: fused parameters} and {module:
    nn.Linear} of target_parameters, modules_to_save's modules, {module: its factors' specs}), every layout checked.
    Pure (no collective)."""
    config = rewrite_expert_targets(model, config)  # transformers 4's expert names, as peft rewrites them
    targets = resolve_targets(model, config, part=part)
    experts, weights = resolve_parameter_targets(model, config, part=part)
    both = sorted(set(targets) & set(weights))
    if both:
        raise ValueError(f"{both[0]!r} is targeted by both target_modules and target_parameters (its weight); "
                         "name it in one of them")
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        config = dataclasses.replace(config, target_modules=sorted(targets))  # as peft saves it
    layout = state_of(model).tp
    plan = layout.plan if layout is not None else {}
    factors = {n: factor_specs(plan.get(n), _spec(layout, f"{n}.weight"), n) for n in {**targets, **weights}}
    for name, fused in experts.items():
        if is_fused_experts(model.get_submodule(name)):
            for p in fused:
                fused_factor_specs(_spec(layout, f"{name}.{p}"), f"{name}.{p}")
        else:
            for p in STACKED:
                expert_factor_specs(_spec(layout, f"{name}.{p}"), f"{name}.{p}")
    return config, targets, experts, weights, modules_to_save(model, config, part=part), factors


def _resolve_stage(model: nn.Module, config: LoraConfig):
    """`_resolve` on a pipeline stage, which may hold none of the targets: a stage's error, or a target matching
    nothing on any stage, raised on every rank (ValueError). Collective (world)."""
    resolved, error = None, None
    try:
        resolved = _resolve(model, config, part=True)
    except Exception as exc:  # noqa: BLE001 - raised below on every rank
        error = exc
    raise_on_any_rank(error, exc_type=ValueError)
    _, targets, experts, weights, full_modules, _ = resolved
    entries = config.modules_to_save or []
    found = comm.all_gather_object((bool(targets), bool(experts or weights),
                                    [e for e in entries if any(n.endswith(e) for n in full_modules)]))
    where = f"any pipeline stage of {type(model).__name__}"
    missing = [e for e in entries if not any(e in saved for _, _, saved in found)]
    error = (f"LoraConfig.target_modules={config.target_modules!r} matches no module of {where}"
             if config.target_modules and not any(t for t, _, _ in found) else
             f"LoraConfig.target_parameters={config.target_parameters!r} matches no parameter of {where}"
             if config.target_parameters and not any(p for _, p, _ in found) else
             f"LoraConfig.modules_to_save entries {missing} match no module of {where}" if missing else None)
    raise_on_any_rank(error, exc_type=ValueError)
    return resolved


def _is_lora(name: str) -> bool:
    return ".lora_" in name


def _spec(layout, name: str) -> ShardSpec:
    return layout.spec(name) if layout is not None else ShardSpec()


def _agree_seed(model: nn.Module, layout) -> int:
    """A seed drawn from the global RNG, made equal on every rank (max over the world): replicated factors and
    dropout masks then agree across TP ranks, and initial adapters across data-parallel replicas."""
    seed = int(torch.randint(0, 2**62, ()))
    if layout is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return seed
    t = torch.tensor([seed], dtype=torch.int64, device=next(model.parameters()).device)
    comm.all_reduce(t, None, op=dist.ReduceOp.MAX, phase="setup")
    return int(t.item())


def _wrap(model: nn.Module, name: str, module: nn.Module, config: LoraConfig, specs: tuple[ShardSpec, ShardSpec],
          layout, runtime: LoraRuntime, key: str) -> LoraLayer:
    shape = layout.global_shapes[f"{name}.weight"] if layout is not None else tuple(module.weight.shape)
    linear = isinstance(module, nn.Linear)
    full_out, full_in = shape if linear else shape[::-1]  # Linear (out, in); Embedding (vocab, dim): A reads vocab
    half = module.weight.dtype in (torch.float16, torch.bfloat16)
    cls = LoraLinear if linear else LoraEmbedding
    r, scaling = config.rank_and_scaling(key)
    layer = cls(module, name=name, r=r, scaling=scaling, dropout=config.lora_dropout, specs=specs,
                ctx=layout.ctx if layout is not None else None, runtime=runtime, full_in=full_in, full_out=full_out,
                dtype=torch.float32 if half else module.weight.dtype)  # peft keeps half-precision adapters in fp32
    return _install(model, name, layer, layout)


def _install(model: nn.Module, name: str, layer, layout):
    """Put adapter `layer` in place of module `name`: the base's parameters move under `base_layer.` in the layout
    table, and the adapter's factors join it."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)
    if layout is not None:
        layout.rename(f"{name}.", f"{name}.base_layer.")
        for local, (spec, global_shape) in layer.layout().items():
            layout.add(f"{name}.{local}", spec, global_shape)
    return layer


def _wrap_experts(model: nn.Module, name: str, fused: tuple[str, ...], config: LoraConfig, layout,
                  runtime: LoraRuntime) -> LoraExperts:
    module = model.get_submodule(name)
    stacked = FUSED if is_fused_experts(module) else STACKED  # transformers' fused stacks, or tptrain's
    shapes = {p: layout.global_shapes[f"{name}.{p}"] if layout is not None else tuple(getattr(module, p).shape)
              for p in stacked}
    dtype = module.down_proj.dtype
    specs = {p: _spec(layout, f"{name}.{p}") for p in stacked}
    ranks = {t: config.rank_and_scaling(f"{name}.{t}") for t in fused}
    cls = LoraFusedExperts if stacked is FUSED else LoraExperts
    layer = cls(module, name=name, ranks=ranks, shapes=shapes if cls is LoraFusedExperts else shapes["gate_proj"],
                specs=specs, ctx=layout.ctx if layout is not None else None, runtime=runtime,
                dtype=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    return _install(model, name, layer, layout)


def _trainable_extras(model: nn.Module, config: LoraConfig, targets, full_modules: list[str]) -> list[str]:
    """Base parameters trained and saved with the adapter: biases per `bias`, and modules_to_save."""
    names = [n for n, _ in model.named_parameters()]
    if config.bias == "all":
        out = [n for n in names if n == "bias" or n.endswith(".bias")]
    elif config.bias == "lora_only":
        out = [f"{t}.base_layer.bias" for t in targets if f"{t}.base_layer.bias" in names]
    else:
        out = []
    out += [n for n in names for m in full_modules if n.startswith(f"{m}.") and n not in out]
    return out
