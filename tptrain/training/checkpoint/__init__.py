"""Resumable training checkpoints (DCP), not the Hugging Face export (that is tptrain/io):

    state.py         the training state under global shapes, saved from each rank's own shards and resharded on
                     resume (2-D DTensor views of FSDP x TP, no gather)
    fused_shards.py  a fused tensor's pieces (segments x FSDP) as ShardedTensor boxes, for DCP
    dirs.py          the directory protocol: atomic publish, lineage-only pruning, manifest, fall-back, and what a
                     restarted (elastic) attempt resumes
"""
