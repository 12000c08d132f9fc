"""What several test files share, one home per helper, by topic (no test file imports another):

    ranks        run a function on N CPU/gloo ranks (a fork server, a deadline), the `distributed` marker's guard
    launch       `tptrain train` and launchers as subprocesses; their metrics
    configs      the tiny configs: tensor parallelism's, the Trainer's, the pipeline's, each family's, MoE,
                 DeepSeek-V3, context parallelism's, a ~150 MB Qwen3
    batches      one labelled-batch builder; the families' batch; data-parallel and packed batches
    checkpoints  tiny checkpoints written by transformers or tptrain; what tests/conftest.py's `checkpoints`
                 fixture writes from a module's CHECKPOINTS
    references   one process: transformers' logits and loss, the Trainer's training written out by hand
    compare      a distributed model against its one-process reference (gathered gradients and parameters)
    trainer      the Trainer tests' tiny model, data and arguments
    pipeline     the Trainer under pipeline x data parallelism against one process
    lora         random adapters, a saved adapter's shapes, adapters crossed with peft
    chat         SFT: the ChatML tokenizer, chat templates and records, a checkpoint to fine-tune
    backend      the transformers backend's tiny types and its one-process reference
    memory       private memory: its value, its sampled peak
    preference   DPO: a tiny chat checkpoint, preference records, gathered tensors and recorded gradients
    grpo         GRPO: toy verifiable rewards, prompt records, the bundled model, a run's metrics
    vlm          vision-language models: tiny checkpoints of each family, batches with images, their comparison
    vision_data  image-text chat records, images on disk, processors' checkpoints

The fixtures live in tests/conftest.py. Modules import transformers inside their functions: the ranks a test
starts import them (ranks.py preloads them in its fork server, which must not import transformers).
"""
