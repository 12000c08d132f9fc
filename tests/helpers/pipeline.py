"""The Trainer under pipeline parallelism composed with data, tensor and expert parallelism against one process
(test_pipeline_data_parallel.py, test_optim_in_backward.py): a case trains 3 steps and compares the losses, the eval
loss and the parameters read back from final/. The checkpoints are tests.helpers.checkpoints.save_family's."""
from __future__ import annotations

import os

import torch

from tests.helpers.compare import TOL
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM


def pipeline_trainer(root: str, family: str, out: str, *, schedule: str = "1F1B", pp: int = 2, dp_shard: int = 1,
             dp_replicate: int = 1, ep: int | None = None, tp: int = 1, steps: int = 3, accumulation: int = 1,
             microbatches: int = 2, **kw):
    """A Trainer of `family` at pp x dp_replicate x dp_shard x tp (ep inside dp_shard), one row per dp rank and
    pipeline microbatch in each micro-batch."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    sizes = dict(dp_shard_size=dp_shard, dp_replicate_size=dp_replicate, ep_size=ep, tp_size=tp)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, family), dtype=torch.float64,
                                                 distributed_config=DistributedConfig(pp_size=pp, pp_schedule=schedule,
                                                                                      **sizes))
    config = ParallelismConfig(pp_size=pp, pp_schedule=schedule, pp_microbatches=microbatches if pp > 1 else None,
                               **sizes)
    args = training_args(os.path.join(root, out), max_steps=steps, per_device_train_batch_size=microbatches,
                         gradient_accumulation_steps=accumulation, parallelism_config=config, **kw)
    return Trainer(model, args=args, train_dataset=tiny_dataset())


def train_case(root: str, family: str, schedule: str, *, dp_shard: int = 1, dp_replicate: int = 1,
                ep: int | None = None, tp: int = 1, accumulation: int = 1, microbatches: int = 2,
                evaluate: bool = False, **kw) -> None:
    """3 steps of `family` at pp 2 x dp_replicate x dp_shard x tp against one process (`kw`: more TrainingArguments):
    the losses, the eval loss (`evaluate`), and the parameters read back from final/."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    import torch.distributed as dist

    what = f"{family} {schedule} pp 2 x dp_replicate {dp_replicate} x dp_shard {dp_shard} x tp {tp} (ep {ep}) {kw}"
    out = "".join(c if c.isalnum() else "_" for c in what)
    trainer = pipeline_trainer(root, family, out, schedule=schedule, dp_shard=dp_shard, dp_replicate=dp_replicate,
                               ep=ep, tp=tp, accumulation=accumulation, microbatches=microbatches, **kw)
    dp = dp_shard * dp_replicate > 1
    assert trainer.fsdp == dp and all(isinstance(m, FSDPModule) == dp for m in trainer.pipeline.modules), what
    left = left_for_the_step(trainer) if trainer.args.optim_in_backward else None
    losses = trainer.train().losses
    if left is not None:  # stepped in backward but the gradients summed after it (tied copies, TP partials)
        held = trainer.pipeline.ties.summed_after() | set(trainer.inner.parallel.tp.partial_grad_specs())
        assert len(left) == 3 and all(names <= held for names in left), (what, left, held)
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, family), dtype=torch.float64).train()
    expected = reference_losses(ref, tiny_dataset(), trainer.args,
                                global_batch=microbatches * dp_shard * dp_replicate * accumulation)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL,
                               msg=lambda m: f"{what} losses: {m}")
    if evaluate:  # eval_loss over dp and the stages; FSDP2 reshards after a no-grad forward
        held = tiny_dataset(6, seed=2)  # 3 rows per dp rank: the second batch of 2 is padded
        rows = torch.stack([held[i] for i in range(len(held))])
        with torch.no_grad():
            want = ref.eval()(rows, labels=rows).loss.item()
        torch.testing.assert_close(trainer.evaluate(held)["eval_loss"], want, **TOL)
        assert all(isinstance(p, DTensor) for p in trainer.inner.parameters()), what
    if dist.get_rank() == 0:  # final/: one ordinary checkpoint, gathered over dp and sent from the stages
        saved = dict(AutoModelForCausalLM.from_pretrained(os.path.join(root, out, "final")).named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), **TOL,
                                       msg=lambda m: f"{what}: {name} after 3 steps: {m}")
    dist.barrier()


def left_for_the_step(trainer) -> list[set[str]]:
    """Records, at each optimizer.step() of an optim_in_backward run, the parameters still holding a gradient."""
    left, step = [], trainer.optimizer.step

    def recording(closure=None):
        left.append({n for n, p in trainer.inner.named_parameters() if p.grad is not None})
        step()
    trainer.optimizer.step = recording
    return left


def train_cases(root: str, cases: list[tuple]) -> None:
    """train_case of each (family, schedule, keywords) in `cases`."""
    for family, schedule, kw in cases:
        train_case(root, family, schedule, **kw)
