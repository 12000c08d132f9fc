"""GRPO's option values, importable without torch (`tptrain grpo`'s flags read them)."""

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo")  # TRL 1.16's, "dapo" its default
SCALE_REWARDS = ("group", "batch", "none")
