"""The optimizer's kernel (training/optim.adamw_kernels): torch's fused AdamW wherever the parameters' devices have
it, the same parameters as the per-tensor loop (fp64, 1e-12) on one device (tests/test_trainer.py) and on FSDP2's
DTensor shards here; the optimizer in backward takes the same kernel per parameter."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain.parallel.grad_sync import local_tensor
from tptrain.training.args import ParallelismConfig
from tptrain.training.optim import adamw_kernels, build_optimizer
from tptrain.training.optim_in_backward import OptimizerInBackward
from tptrain.training.trainer import Trainer

EXACT = dict(rtol=1e-12, atol=1e-12)


def test_fused_where_the_device_has_it_else_torchs_choice(tmp_path):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):  # CPU has the fused kernel for each
        assert adamw_kernels("adamw_torch_fused", [torch.zeros(2, dtype=dtype)]) == {"fused": True, "foreach": False}
    # no fused (nor foreach) kernel on the meta device: the loop, not the error fused=True would raise
    assert adamw_kernels("adamw_torch_fused", [torch.zeros(2), torch.zeros(2, device="meta")]) == {
        "fused": False, "foreach": False}
    assert adamw_kernels("adamw_torch", [torch.zeros(2)]) == {"fused": None, "foreach": None}  # torch's default
    args = training_args(tmp_path, max_grad_norm=0.0)
    assert build_optimizer(tiny_model(), args).defaults["fused"] is True
    in_bwd = OptimizerInBackward(tiny_model(), training_args(tmp_path, max_grad_norm=0.0, optim_in_backward=True))
    assert all(opt.defaults["fused"] is True for opt, _ in in_bwd._per_param.values())


def _fsdp_worker(tmp: str) -> None:
    params = {}
    for optim in ("adamw_torch_fused", "adamw_torch"):
        args = training_args(f"{tmp}/{optim}", optim=optim, max_steps=3, warmup_steps=1, save_steps=0,
                             parallelism_config=ParallelismConfig(1, dp_shard_size=2))
        trainer = Trainer(model=tiny_model(), args=args, train_dataset=tiny_dataset())
        assert trainer.optimizer.defaults["fused"] is (optim == "adamw_torch_fused" or None)
        trainer.train()
        params[optim] = {n: local_tensor(p).clone() for n, p in trainer.inner.named_parameters()}
    assert type(next(trainer.inner.parameters())).__name__ == "DTensor"  # FSDP2's shards went through the kernel
    for name, p in params["adamw_torch_fused"].items():
        torch.testing.assert_close(p, params["adamw_torch"][name], **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_fused_on_fsdp2_shards_equals_the_loop(tmp_path):
    """fp64, 3 steps with weight decay, warmup and clipping: the fused kernel on FSDP2's DTensor shards gives the
    parameters of the per-tensor loop to 1e-12."""
    run_distributed(_fsdp_worker, 2, str(tmp_path))
