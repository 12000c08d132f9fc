"""The preference objectives' names (TRL's), without torch: `tptrain dpo`'s flags read them before anything loads."""

# TRL 1.16's DPOConfig.loss_type values that need only sequence log-probabilities and token counts, with the two
# reference-free objectives of trl.experimental (CPOTrainer's "simpo", ORPOTrainer's odds-ratio loss).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sft", "sigmoid_norm")
REFERENCE_FREE_LOSS_TYPES = ("simpo", "orpo")
LOSS_TYPES = DPO_LOSS_TYPES + REFERENCE_FREE_LOSS_TYPES
# TRL's loss types whose weighting is across the batch (sorted), not per pair: a batch's order decides each pair's loss
BATCH_SORTED_LOSS_TYPES = ("aot", "aot_unpaired")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# TRL: only the losses built on the chosen - rejected score difference generalise to another f-divergence
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
TRUNCATION_MODES = ("keep_start", "keep_end")
