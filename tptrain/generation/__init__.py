"""Generation on the training shards: `model.generate` (transformers' generate, with a KV cache, under any layout the
rule table lets generate: TP, SP-free, with data parallelism and FSDP2), sampling from vocab-parallel logits, and the
text helpers the CLI uses (`complete`). Imports no model code: a model supplies its cache through its forward
(`use_cache`, `past_key_values`), as transformers' do."""
from tptrain.generation.loop import GenerateDecoderOnlyOutput, generate, layout_refusal
from tptrain.generation.settings import GenerationSettings
from tptrain.generation.text import complete

__all__ = ["GenerateDecoderOnlyOutput", "GenerationSettings", "complete", "generate", "layout_refusal"]
