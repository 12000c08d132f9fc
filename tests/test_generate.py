"""model.generate: greedy generation at tp 2 and tp 4 equal to transformers' generate on one process, token for token
(native families: GQA and replicated KV heads, sliding windows, soft-capping, per-layer RoPE, DeepSeek-V3's latent
attention, a MoE; two types on the transformers backend); the KV cache's logits equal a full forward's; tp 2 x dp 2
under FSDP2 (each dp rank its own prompts, the weights gathered once) and with experts over an ep axis (the ranks
stepping together); sampling from vocab-parallel logits equal to transformers' warpers, reproducible with a seed and
the same at every tp size; stop strings as transformers stops; every bad input refused.

Tiny random checkpoints written by transformers, fp64 (the sampler reads fp32 logits, as transformers' generate).
    .venv/bin/python -m pytest tests/test_generate.py -q
"""
from __future__ import annotations

import os
import re
import shutil
import types
import warnings
from functools import partial

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.checkpoints import random_checkpoint
from tests.helpers.references import transformers_fp64
from tests.helpers.configs import DEEPSEEK_TINY, GEMMA_FAMILIES, MOE_FAMILIES, MOE_TINY, SIMPLE_FAMILIES
from tests.helpers.backend import AXES_FAMILIES as HF_FAMILIES, AXES_TINY as HF_TINY
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.distributed.state import ParallelState
from tptrain.generation import sampling
from tptrain.generation.settings import GenerationSettings
from tptrain.layout import ParallelDims

F64 = torch.float64
NEW = 10  # new tokens per prompt
QWEN3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
# model_type: (backend, transformers config kwargs); prompts left-padded but gemma2's (transformers' eager
# soft-capped attention gives NaN rows for left padding in fp64)
FAMILIES = {
    "qwen3": ("native", QWEN3),  # 2 KV heads: one per rank at tp 2, replicated at tp 4
    "mistral": ("native", SIMPLE_FAMILIES["mistral"]),  # a window of 5 keys < prompt + new tokens
    "gemma2": ("native", GEMMA_FAMILIES["gemma2"]),  # soft-capped scores and logits, windows
    "gemma3_text": ("native", GEMMA_FAMILIES["gemma3_text"]),  # two RoPE bases, windows
    "deepseek_v3": ("native", DEEPSEEK_TINY),  # latent attention (its compressed cache), grouped routing
    # transformers' generate cannot compute the router aux loss on a cached step: output_router_logits off
    "qwen3_moe": ("native", {**MOE_TINY, **MOE_FAMILIES["qwen3_moe"][2], "vocab_size": 128, "output_router_logits": False}),
    "starcoder2": ("transformers", {**HF_TINY, **HF_FAMILIES["starcoder2"]}),  # transformers' DynamicCache
    "gpt_neox": ("transformers", {**HF_TINY, **HF_FAMILIES["gpt_neox"]}),
}
AT_TP4 = ("qwen3", "gemma3_text", "deepseek_v3", "qwen3_moe", "starcoder2")
SAMPLING = {"plain": {}, "top_k": dict(top_k=5), "top_p": dict(top_k=0, top_p=0.7), "min_p": dict(top_k=0, min_p=0.2),
            "top_k_top_p_min_p": dict(top_k=8, top_p=0.8, min_p=0.05, temperature=0.7)}


def _prompts(seed: int, *, padded: bool = True, batch: int = 3, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask): random prompts, left-padded to `length` (rows of 9, 5, 8, 5, 8, ... tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1::2, :4], mask[2::2, :1] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def _reference(hf, ids, mask, **kw) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{model_type: (directory, backend, ids, mask, eos, transformers' greedy generate)}: eos is a token row 0's
    unstopped continuation reaches in the middle, so finished rows are padded too."""
    import transformers
    out = {}
    for i, (name, (backend, kw)) in enumerate(FAMILIES.items()):
        config = transformers.AutoConfig.for_model(name, **kw)
        path, _ = random_checkpoint(tmp_path_factory.mktemp(name), partial(transformers.AutoModelForCausalLM.from_config,
                                                                     config), norm_weight=0.0 if "gemma" in name else 1.0)
        hf = transformers_fp64(path)
        ids, mask = _prompts(i, padded=name != "gemma2")
        eos = int(_reference(hf, ids, mask, eos_token_id=None)[0, ids.shape[1] + NEW // 2])
        out[name] = (str(path), backend, ids, mask, eos, _reference(hf, ids, mask, eos_token_id=eos))
    return out


def _load(path: str, backend: str, **sizes):
    from tests.helpers.backend import eager_experts
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, backend=backend,
                                                 distributed_config=DistributedConfig(**sizes) if sizes else None)
    if backend == "transformers":
        eager_experts(model)
    return model


def _greedy(model, case) -> torch.Tensor:
    _, _, ids, mask, eos, _ = case
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos)


# ------------------------------------------------------------------ one process


def test_cache_logits_equal_a_full_forward(checkpoints):
    """Prefill 5 tokens, then one token per step through the cache: every real position's logits equal one forward
    over the whole sequence (the padded row's too), for every family, both backends."""
    for name, (path, backend, ids, mask, _, _) in checkpoints.items():
        model = _load(path, backend)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        with torch.no_grad():
            full = model(ids, attention_mask=mask, position_ids=positions).logits
            out = model(ids[:, :5], attention_mask=mask[:, :5], position_ids=positions[:, :5], use_cache=True)
            steps = [out.logits]
            for t in range(5, ids.shape[1]):
                out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                            past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits)
        real = mask.bool()
        torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-10, atol=1e-10, msg=name)


def test_sampling_equals_transformers_warpers():
    """For any uniform u, the token drawn is the inverse of the cumulative distribution transformers' warpers leave
    (temperature, top-k, top-p, min-p), over the vocabulary in id order."""
    import transformers.generation.logits_process as lp
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128, generator=g) * 3
    uniforms = torch.rand(64, generator=g, dtype=F64)
    for name, kw in {**SAMPLING, "default_top_k": dict(top_k=50)}.items():
        s = _settings(**kw)
        scores = logits.clone()
        for warper in ([lp.TemperatureLogitsWarper(s.temperature)] if s.temperature != 1.0 else []) + (
                [lp.TopKLogitsWarper(s.top_k)] if s.top_k else []) + (
                [lp.TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []) + (
                [lp.MinPLogitsWarper(s.min_p)] if s.min_p is not None else []):
            scores = warper(None, scores)
        cdf = scores.softmax(-1).double().cumsum(-1)
        expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
        got = sampling.next_tokens(logits, s, sampling.VocabShard(), uniforms)
        assert torch.equal(got, expected), name
        kept = torch.isfinite(scores).gather(1, got[:, None])
        assert kept.all(), name


def _settings(**kw) -> GenerationSettings:
    base = dict(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                eos_token_ids=(2,), pad_token_id=0, stop_strings=())
    return GenerationSettings(**{**base, **kw})


def test_stop_strings_stop_as_transformers(tmp_path):
    """The bundled tokenizer (byte-level BPE), a random Qwen3: a stop string spanning a token boundary, one ending
    inside a token, and one that appears only later; the same sequences as transformers' generate with the same
    stop strings and tokenizer."""
    import transformers
    from importlib.resources import files
    bundled = files("tptrain") / "data" / "tiny-qwen3"
    config = transformers.AutoConfig.for_model("qwen3", **{**QWEN3, "vocab_size": 4096})
    path, hf = random_checkpoint(tmp_path / "q", partial(transformers.AutoModelForCausalLM.from_config,
                                                                  config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(str(bundled / name), path / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf, model = transformers_fp64(path), _load(str(path), "native")
    ids, mask = _prompts(7, batch=2)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    text = tokenizer.decode(free[0, ids.shape[1]:])
    stops = [text[3:7], text[-2:] + "never"]  # the first stops row 0 mid-way; the second never matches
    # an eos token (never drawn here): a row stopped is padded; none (transformers' explicit None, our []): it runs on
    for eos, ours in ((1, 1), (None, [])):
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, stop_strings=stops,
                               tokenizer=tokenizer, pad_token_id=0, eos_token_id=eos)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, stop_strings=stops, tokenizer=tokenizer,
                             pad_token_id=0, eos_token_id=ours)
        assert torch.equal(got, expected), (eos, got, expected)
        assert (got[0, ids.shape[1]:] == 0).any() == (eos is not None)  # row 0 stopped early, then padded


def test_bad_input_is_refused(checkpoints):
    path, backend, ids, mask, _, _ = checkpoints["qwen3"]
    model = _load(path, backend)
    cases = {
        "max_new_tokens=60 reach 69 positions, past Qwen3ForCausalLM's max_position_embeddings=64; lower "
        "max_new_tokens to 55": dict(max_new_tokens=60),
        "max_new_tokens must be a positive integer, got 0": dict(max_new_tokens=0),
        "need the model's tokenizer to spell the tokens: pass tokenizer=": dict(stop_strings=["ab"]),
        "temperature must be > 0 when sampling": dict(do_sample=True, temperature=0.0),
        "output_logprobs=True returns them in GenerateDecoderOnlyOutput.logprobs": dict(output_logprobs=True),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            model.generate(ids, attention_mask=mask, **kw)
    right = torch.flip(mask, [1])
    with pytest.raises(ValueError, match="prompt 1 is not left-padded .* padding_side='left'"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match="hold the pad token 0 but no attention_mask was given.*padding_side='left'"):
        model.generate(ids, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(TypeError, match="input_ids must be a .batch, seq. tensor of token ids"):
        model.generate(ids[0].float(), max_new_tokens=2)
    for dims, where in ((ParallelDims(pp=2), "pipeline stages (pp_size=2)"),
                        (ParallelDims(cp=2), "context parallelism (cp_size=2)")):
        model.parallel = ParallelState(dims=dims)
        with pytest.raises(ValueError, match=f"model.generate cannot (run on|keep a KV cache under) {re.escape(where)}"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
    sp = types.SimpleNamespace(ctx=types.SimpleNamespace(sequence_parallel=True))
    model.parallel = ParallelState(dims=ParallelDims(tp=2), tp=sp)
    with pytest.raises(ValueError, match="cannot keep a KV cache under sequence parallelism .tp_size=2.*use_cache=False"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2)


# ------------------------------------------------------------------ tensor parallel


def _tp_worker(tp: int, checkpoints: dict, sampled: dict) -> None:
    for name, case in checkpoints.items():
        if tp == 4 and name not in AT_TP4:
            continue
        model = _load(case[0], case[1], tp_size=tp)
        got = _greedy(model, case)
        assert torch.equal(got, case[5]), (tp, name, got, case[5])
    if tp == 2:
        _sampling_and_refusals(checkpoints, sampled)


def _sampling_and_refusals(checkpoints: dict, sampled: dict) -> None:
    """The sampled tokens and log-probs of one process, with the same seeds; a TP group given different prompts is
    refused on both ranks; the compressed cache's logits at tp 2 equal a full forward's."""
    path, backend, ids, mask, _, _ = checkpoints["qwen3"]
    model = _load(path, backend, tp_size=2)
    for name, (expected, logprobs) in sampled.items():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, generator=11,
                             return_dict_in_generate=True, output_logprobs=True, **SAMPLING[name])
        assert torch.equal(out.sequences, expected), (name, out.sequences, expected)
        torch.testing.assert_close(out.logprobs, logprobs, rtol=1e-5, atol=1e-5, msg=name)
    rank = torch.distributed.get_rank()
    with pytest.raises(ValueError, match="ranks of a TP group were given different prompts"):
        model.generate(ids + rank, attention_mask=mask, max_new_tokens=2)
    model = _load(checkpoints["deepseek_v3"][0], "native", tp_size=2)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        steps = [out.logits] + [model(ids[:, t:t + 1], past_key_values=out.past_key_values).logits
                                for t in range(4, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_under_tp_equals_transformers(checkpoints, tp):
    sampled = {}
    if tp == 2:  # one process's draws with the same seed: the tokens every rank of the group must pick
        path, backend, ids, mask, _, _ = checkpoints["qwen3"]
        model = _load(path, backend)
        for name, kw in SAMPLING.items():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, generator=11,
                                 return_dict_in_generate=True, output_logprobs=True, **kw)
            again = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, generator=11, **kw)
            assert torch.equal(again, out.sequences), name  # reproducible with a seed
            sampled[name] = (out.sequences, out.logprobs)
        assert len({tuple(s.flatten().tolist()) for s, _ in sampled.values()}) > 1  # the settings draw differently
    run_distributed(_tp_worker, tp, tp, checkpoints, sampled, timeout=600)


def _dp_worker(checkpoints: dict, expected: dict) -> None:
    """tp 2 x dp_shard 2 under FSDP2: each dp rank its own prompts; the weights gathered once for the whole
    generation (one all-gather per FSDP2 unit), sharded again after it; then experts over an ep axis of the dp
    ranks, one dp rank finishing long before the other (its ranks step on for the all-to-alls)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from tptrain.distributed.topology import dp_mesh
    from tptrain.parallel.parallelize import ParallelOptions, parallelize
    path, backend = checkpoints["qwen3"][:2]
    model = _load(path, backend, tp_size=2)
    dp = dp_mesh(model.parallel.mesh).get_local_rank()
    parallelize(model, model.parallel.mesh, ParallelOptions(train=True), device=torch.device("cpu"))
    gathers = []
    original = _fsdp_param_group.foreach_all_gather
    _fsdp_param_group.foreach_all_gather = lambda *a, **k: gathers.append(1) or original(*a, **k)
    ids, mask, reference = expected["qwen3"][dp]
    try:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=2)
    finally:
        _fsdp_param_group.foreach_all_gather = original
    assert torch.equal(got, reference), (dp, got, reference)
    assert len(gathers) == 3, gathers  # the two layers and the root, once each
    assert all(p.to_local().numel() < p.numel() for p in model.parameters() if p.dim() == 2)  # sharded again
    model.train()
    model(ids, labels=ids).loss.backward()  # FSDP2 as it was
    path, backend = checkpoints["qwen3_moe"][:2]
    model = _load(path, backend, tp_size=2, ep_size=2)
    ids, mask, reference = expected["qwen3_moe"][dp]
    got = model.generate(ids, attention_mask=mask, max_new_tokens=2 + 6 * dp, pad_token_id=0, eos_token_id=2)
    assert torch.equal(got, reference), (dp, got, reference)


@pytest.mark.distributed
def test_tp2_dp2_each_dp_rank_its_own_prompts(checkpoints):
    expected = {}
    for name in ("qwen3", "qwen3_moe"):
        path, backend = checkpoints[name][:2]
        hf = transformers_fp64(path)
        expected[name] = []
        for dp in range(2):
            ids, mask = _prompts(20 + dp, batch=2 + dp)
            new = NEW if name == "qwen3" else 2 + 6 * dp
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                  eos_token_id=2)
            expected[name].append((ids, mask, out))
    run_distributed(_dp_worker, 4, checkpoints, expected, timeout=600)


# ------------------------------------------------------------------ tptrain generate


def _cli_checkpoint(root) -> tuple[str, str]:
    """(a random Qwen3 with the bundled tokenizer, a ChatML template file)."""
    import transformers
    from tests.helpers.chat import BUNDLED, CHATML_GENERATION
    config = transformers.AutoConfig.for_model("qwen3", **{**QWEN3, "vocab_size": 4096})
    path, _ = random_checkpoint(root / "cli", partial(transformers.AutoModelForCausalLM.from_config, config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, path / name)
    (root / "chatml.jinja").write_text(CHATML_GENERATION)
    return str(path), str(root / "chatml.jinja")


@pytest.mark.distributed
def test_cli_generates_at_tp2_as_one_process(tmp_path):
    """`tptrain generate --tp-size 2 --nproc-per-node 4` (dp 2): text and chat prompts from a file and one from
    --prompt, greedy; rank 0 prints each continuation in order, the ones `complete` gives on one process."""
    import json
    import subprocess
    import sys

    from tests.helpers.ranks import require_distributed_marker
    from tests.helpers.launch import ROOT
    from tptrain.generation import complete
    from tptrain.text import load_chat_template, load_tokenizer
    path, template = _cli_checkpoint(tmp_path)
    records = [{"prompt": "To be, or not"}, {"prompt": [{"role": "user", "content": "Once upon"}]},
               {"prompt": ""}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    require_distributed_marker("tptrain generate")
    run = subprocess.run([sys.executable, "-m", "tptrain", "generate", "--model", path, "--prompts",
                          str(tmp_path / "prompts.jsonl"), "--prompt", "Friends", "--chat-template", template,
                          "--tp-size", "2", "--nproc-per-node", "4", "--max-new-tokens", "6", "--batch-size", "1",
                          "--dtype", "float64"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
                              "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    printed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    chat = load_chat_template(path, template).text(records[1]["prompt"], add_generation_prompt=True)
    texts = ["Friends", records[0]["prompt"], chat, ""]
    model = _load(path, "native")
    expected = complete(model, load_tokenizer(path), texts, max_new_tokens=6)
    assert [p["prompt"] for p in printed] == ["Friends", *(r["prompt"] for r in records)]
    assert [p["completion"] for p in printed] == expected, (printed, expected)


def test_cli_refuses_bad_input_before_starting(tmp_path, capsys):
    from tests.helpers.chat import BUNDLED
    from tptrain.cli import main
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    cases = {("--prompts", str(tmp_path / "bad.jsonl")): 'bad.jsonl line 1: expected {"prompt": text or a list',
             ("--prompts", str(tmp_path / "missing.jsonl")): "missing.jsonl is not a file",
             (): "give --prompt TEXT (repeatable) or --prompts FILE.jsonl",
             ("--prompt", "x", "--tp-size", "3", "--nproc-per-node", "2"): "--nproc-per-node 2",
             ("--prompt", "x", "--max-new-tokens", "0"): "--max-new-tokens must be a positive integer, got 0"}
    for flags, message in cases.items():
        assert main(["generate", "--model", str(BUNDLED), *flags]) == 2
        assert message in capsys.readouterr().err, flags
