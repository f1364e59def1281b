"""`jaxtune info --compile-for`: the real train step compiled by libtpu for Cloud TPU slices on this CPU machine.

References: XLA's own memory analysis and cost analysis of the compiled program, the analytic model (`jaxtune.info`:
parameter bytes, 6N + attention FLOPs), the TPU compiler's out-of-memory refusal, and the real data pipeline's
batches. Compiles cost seconds to a minute on 2 cores, so the shapes are cut (sequence, batch) where the check
does not need the recipe's own.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtune import aot, sharding
from jaxtune.aot import search
from jaxtune.cli import main
from jaxtune.config import ConfigError, load_config
from jaxtune.data import load_tokenizer, make_training_data
from jaxtune.info import info

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed: pip install 'jaxtune[aot]'")

# GPT-2 small enough to compile in seconds (d_model 64, 3 layers), for the checks that need no real size.
SMALL = ["model.preset=tiny", "model.n_layer=3", "model.vocab_size=512", "data.seq_len=128", "model.max_seq_len=128"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Hub recipes plan from their family preset: no request leaves the machine."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _state_bytes(cfg, chips: int) -> int:
    m = info(cfg, devices=chips)["memory_per_device"]
    return m["params"] + m["optimizer"]


def assert_within_peaks(d: dict) -> None:
    """A plan cannot beat its chip: the roofline step is at least its FLOPs at peak and its HBM bytes at the HBM
    bandwidth, so MFU is at most 100%; and the analytic model FLOPs (MFU's numerator) are no more than the program's
    matmuls, unless Pallas kernels hide those (5%: a tiny model's analytic count, measured up to 3.4% over, counts
    whole rows of attention where a group's regions mask some). The 6N of a LoRA step, whose frozen weights get no
    gradient, broke the last (a GRPO plan printed MFU 109%)."""
    s, rl = d["slice"], d["roofline"]
    assert rl["step_seconds"] >= d["flops_per_chip"] / s["peak_flops"] * (1 - 1e-9)
    assert rl["step_seconds"] >= d["hbm_bytes_per_chip"] / s["hbm_bw"] * (1 - 1e-9)
    assert 0 < rl["mfu"] <= 1, rl["mfu"]
    if not rl["kernels"]:
        assert rl["model_flops"] / s["chips"] <= 1.05 * d["flops_per_chip"], (rl["model_flops"], d["flops_per_chip"])


# The gpt2-124m recipe (its model, AdamW, bf16 compute, micro-batches, pure data parallelism) at 16 x 256 tokens,
# with the layers in a scan (a loop XLA's cost analysis counts once).
GPT2 = ["train.batch_size=16", "train.micro_batches=2", "data.seq_len=256", "model.scan_layers=true"]


@pytest.fixture(scope="module")
def gpt2_plan():
    cfg = load_config("gpt2-124m", GPT2)
    return cfg, aot.plan(cfg, "v5e-8")


@pytest.mark.slow
def test_gpt2_124m_compiles_for_v5e_8_with_its_state_flops_and_gradient_all_reduce(gpt2_plan):
    """Tolerances: XLA's argument bytes are the state each chip holds (float32 params and two AdamW moments,
    replicated) plus its batch rows and scalars: within 0.1%. FLOPs: the HLO's matmuls against 6N + 12 L D T (no
    remat, no LoRA; both count attention's two matmuls in full): within 5%, the analytic count leaving out only
    what is not a matmul (softmax, norms, the optimizer's elementwise update), which the HLO's matmul count also
    leaves out."""
    cfg, d = gpt2_plan
    assert d["fits"] and d["mesh"] == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    assert d["slice"]["device_kind"] == "TPU v5 lite" and d["slice"]["chips"] == 8
    state = _state_bytes(cfg, 8)
    batch_rows = 2 * 256 * 4 * 2  # inputs and targets: 2 rows per chip, int32
    assert d["memory"]["arguments"] == pytest.approx(state + batch_rows, rel=1e-3)
    assert d["memory"]["aliased"] >= state  # the donated state is updated in place
    analytic = info(cfg, devices=8)["flops_per_step"]
    assert d["flops_per_chip"] * 8 == pytest.approx(analytic, rel=0.05)
    assert d["loops"] >= 2 and d["loops_unknown"] == 0  # the micro-batch scan and the layer scan
    assert d["xla_cost"]["flops"] < 0.5 * d["flops_per_chip"]  # one layer and one micro-batch of each loop
    # Pure data parallelism: only all-reduces, over all 8 chips. Every gradient is reduced at least once in at least
    # 16 bits; at most in float32 once per micro-batch, the tied embedding twice (its gather and the head).
    c = d["collective_bytes"]
    assert c["all-reduce"] > 0 and c["all-gather"] == c["reduce-scatter"] == c["all-to-all"] == 0
    n, head = info(cfg, devices=8)["params"], 50304 * 768
    assert 2 * n <= c["all-reduce"] <= 2 * 4 * (n + head)
    assert d["ici_bytes"] == pytest.approx(2 * 7 / 8 * c["all-reduce"], rel=1e-6)
    rl = d["roofline"]
    assert rl["step_seconds"] == max(rl["seconds"].values()) and rl["bound"] in rl["seconds"]
    assert rl["seconds"]["compute"] == pytest.approx(d["flops_per_chip"] / 197e12)
    assert 0 < rl["mfu"] < 1 and rl["tokens_per_second"] == pytest.approx(16 * 256 / rl["step_seconds"])
    assert_within_peaks(d)


@pytest.mark.slow
def test_remat_trades_temporaries_for_recomputed_matmuls(gpt2_plan):
    """With every layer rematerialised (model.remat=full) the same step keeps fewer activations (its temporaries
    shrink) and recomputes each layer's forward matmuls: the layers' 6N becomes 8N; the head and attention are not
    recomputed in full, so the total grows by less than a third (1.15 to 1.34). model.remat=offload is full remat
    with every layer's input kept in the host's pinned memory: the program holds at least the 12 layers' inputs there
    (a chip's row of a micro-batch: 256 positions x 768, bf16, each), its device temporaries are below full remat's
    by at least as much, it computes the same matmuls (3%), and the plan says how much host memory it takes."""
    _, base = gpt2_plan
    plans = {r: aot.plan(load_config("gpt2-124m", [*GPT2, f"model.remat={r}"]), "v5e-8") for r in ("full", "offload")}
    full, offload = plans["full"], plans["offload"]
    assert full["fits"] and full["memory"]["temporaries"] < 0.8 * base["memory"]["temporaries"]
    assert 1.15 < full["flops_per_chip"] / base["flops_per_chip"] < 1.34
    inputs = 12 * 256 * 768 * 2
    assert base["memory"]["host"] == full["memory"]["host"] == 0 and offload["memory"]["host"] >= inputs
    assert offload["fits"] and offload["memory"]["temporaries"] <= full["memory"]["temporaries"] - inputs
    assert offload["flops_per_chip"] == pytest.approx(full["flops_per_chip"], rel=0.03)  # measured +1.7%
    for d in (full, offload):
        assert_within_peaks(d)
    assert "of the host's memory (model.remat=offload)" in aot.format_plan(offload)


@pytest.mark.slow
def test_llama_1b_lora_compiles_for_v5p_8():
    """The llama-lora recipe (Llama 3.2 1B, planned from its preset offline: bf16 frozen base, rank-16 adapters on
    every projection), layers scanned, on v5p-8: 4 chips, each a megacore device of 2 TensorCores. Its arguments
    are the frozen base and the adapters with their AdamW moments (within 0.1%, plus the batch). FLOPs: LoRA
    computes no gradient for the frozen weights, so the backward pass is one matmul per weight instead of two: the
    analytic count is 4 per frozen weight and 6 per adapter weight, which the HLO's matmuls match (1.0 to 1.1:
    the model's FLOPs leave out what is not a model matmul). Under the old 6N it was 0.6 to 0.75."""
    cfg = load_config("llama-lora", ["data.seq_len=128", "train.batch_size=4", "model.scan_layers=true"])
    d = aot.plan(cfg, "v5p-8")
    assert d["fits"] and d["slice"]["chips"] == 4 and d["mesh"]["data"] == 4
    assert d["slice"]["device_kind"] == "TPU v5"
    rows = 128 * (4 * 4 + 4)  # a row per chip: inputs, targets, positions, segment_ids (int32), loss_mask
    assert d["memory"]["arguments"] == pytest.approx(_state_bytes(cfg, 4) + rows, rel=1e-3)
    ratio = d["flops_per_chip"] * 4 / info(cfg, devices=4)["flops_per_step"]
    assert 0.98 < ratio < 1.1, ratio
    assert_within_peaks(d)


# A vocabulary of 2^20 with unchunked logits: ~6 GiB of temporaries per 1,024-token row, so the limit on a v5e chip
# is 2 rows and the batch search ends in a few compiles.
WIDE = ["model.preset=tiny", "model.n_layer=1", "model.vocab_size=1048576", "data.seq_len=1024",
        "model.max_seq_len=1024", "train.loss_chunk=1024", "train.micro_batches=1"]


@pytest.mark.slow
def test_memory_grows_with_the_batch_and_the_search_brackets_the_limit():
    """The largest-batch search (doubling from the compiled batch, then bisection, every candidate compiled)
    answers a multiple of the data-parallel degree whose next multiple the compiler refuses: from 16 (2 rows per
    chip), 32 is refused, then 24. Memory per chip grows with the batch along the way: the logits kept for the
    backward pass, a row more per chip each time."""
    p = aot.program(load_config("gpt2-124m", WIDE), "v5e-8")
    first = p.compile(16)
    assert first["fits"] and first["memory"]["temporaries"] > 10 * aot.GiB
    found = aot.largest_batch(p, first, budget_seconds=900)
    assert found == {**found, "batch_size": 16, "refused": 24, "unit": 8, "exact": True, "compiles": 3}
    (b16, _, m16), (b32, _, m32), (b24, _, m24) = found["tried"]
    assert (b16, b32, b24) == (16, 32, 24) and m16 < m24 < m32
    assert m32 - m16 == pytest.approx(2 * (m24 - m16), rel=0.1)  # ~linear in the rows per chip


def test_settle_finds_the_edge_of_a_monotone_test_from_either_side():
    """The search both --max-batch and --max-seq walk: doubling, then bisection, from a fitting or a refused start;
    a cap stops the doubling; a spent budget stops it anywhere with what it knows."""
    for edge in (1, 5, 6, 37, 64):
        for start in (1, 4, 40, 100):
            tried = []

            def fits(k, edge=edge, tried=tried):
                tried.append(k)
                return k <= edge

            assert search.settle(start, start <= edge, fits, lambda: False) == (edge, edge + 1)
            assert len(tried) <= 2 * (edge + start).bit_length() + 1
    assert search.settle(3, True, lambda k: True, lambda: False, cap=20) == (20, None)  # 6, 12, then the cap
    assert search.settle(8, False, lambda k: False, lambda: False) == (0, 1)  # nothing fits
    assert search.settle(2, True, lambda k: True, lambda: True) == (2, None)  # out of time at once


def test_longest_sequence_is_searched_by_compiling_and_stops_at_the_models_context():
    """--max-seq on v5e-8: 48 rows (6 a chip) of the one-layer GPT-2 with its 2^20-token vocabulary, logits unchunked,
    fit at 256 tokens and are refused at 512, the memory per chip of each candidate reported: about twice as much at
    twice the length (the logits and the attention scores, held a chunk of queries at a time by
    `layers.query_chunks`, grow with the length, not its square). (Few rows of large ones: the TPU compiler's time
    grows with the rows a chip holds, 6.5 s at 8 rows of the small model, 72 s at 65,536.) With 8 rows the model's
    own context (max_seq_len 512) comes first, and the plan says that it, not the chip, is the limit."""
    wide = [*WIDE[:3], "train.loss_chunk=1024", "train.micro_batches=1", "model.max_seq_len=1024"]
    p = aot.program(load_config("gpt2-124m", [*wide, "train.batch_size=48", "data.seq_len=256"]), "v5e-8")
    found = aot.longest_sequence(p, budget_seconds=900)
    assert found == {**found, "tokens": 256, "refused": 512, "unit": 256, "exact": True, "capped": False}
    (t256, ok256, m256), (t512, ok512, m512) = found["tried"]
    assert (t256, ok256, t512, ok512) == (256, True, 512, False) and 15.75 * aot.GiB < m512 < 2.5 * m256  # 2.0x
    p = aot.program(load_config("gpt2-124m", [*SMALL[:-2], "model.max_seq_len=512", "train.micro_batches=1",
                                              "train.batch_size=8", "data.seq_len=128"]), "v5e-8")
    d = aot.longest_sequence(p, budget_seconds=900)
    assert d == {**d, "tokens": 512, "refused": None, "capped": True, "compiles": 2}
    text = aot.report._longest_line(d)
    assert text.startswith("longest sequence: 512 tokens fit: the model's own context (max_seq_len 512)")


def test_a_compiled_program_over_the_usable_hbm_is_said_not_to_fit(monkeypatch):
    """A program the TPU compiler accepts whose arguments, temporaries and code pass what a chip may use (here the
    usable figure is lowered to 1 MiB) does not fit: the plan says so with its compiled numbers, not a KeyError."""
    import dataclasses

    from jaxtune.aot import catalog

    monkeypatch.setitem(catalog.CHIPS, "v5e", dataclasses.replace(catalog.CHIPS["v5e"], hbm_usable=2.0 ** 20))
    d = aot.plan(load_config("gpt2-124m", [*SMALL, "train.micro_batches=1", "train.batch_size=8"]), "v5e-8")
    assert not d["fits"] and "compiler" not in d
    text = aot.format_plan(d)
    over = (d["memory"]["total"] - 2.0 ** 20) / aot.GiB
    assert "does not fit: arguments" in text and f"over by {over:.2f} GiB" in text, text


def test_a_batch_too_large_for_v5e_is_refused_with_the_numbers():
    """32 sequences of 1,024 tokens of the wide one-layer GPT-2 on v5e-8 (16 GiB per chip; 4 rows a chip, ~6 GiB of
    logits each): the TPU compiler refuses the program; the plan says "does not fit" with what it needs (the
    compiler's temporaries plus the state) against the 15.75 GiB the compiler allows, and by how much."""
    d = aot.plan(load_config("gpt2-124m", [*WIDE, "train.batch_size=32"]), "v5e-8")
    m = d["memory"]
    assert not d["fits"] and "RESOURCE_EXHAUSTED" in d["compiler"] and "roofline" not in d
    assert m["temporaries"] > 16 * aot.GiB and m["total"] == m["temporaries"] + m["state_and_frozen"]
    text = aot.format_plan(d)
    over = (m["total"] - 15.75 * aot.GiB) / aot.GiB
    assert "does not fit" in text and f"over by {over:.2f} GiB" in text and "of 15.75 GiB usable HBM" in text


def test_hlo_counts_are_exact_on_hand_made_programs():
    """The HLO reading, against programs whose traffic and FLOPs are known exactly: an array sharded 8 ways wanted
    whole on every chip is one all-gather of the whole array ((N-1)/N of it through each chip's links); a scan of 5
    matmuls whose contracting dimension is sharded does 5 partial matmuls per chip and all-reduces each (16, 256)
    float32 result, then gathers the sharded carry, while XLA's cost analysis counts the loop body once."""
    mesh = Mesh(np.array(aot.slice_devices(aot.tpu_slice("v5e-8"))), ("x",))
    split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    f32 = lambda shape, sh: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)

    gathered = jax.jit(lambda a: a, out_shardings=whole).lower(f32((1024, 256), split)).compile()
    h = aot.hlo_counts(gathered.as_text(), 8)
    assert h.collective_bytes == {**dict.fromkeys(aot.COLLECTIVES, 0.0), "all-gather": 1024 * 256 * 4}
    assert h.ici_bytes == 7 / 8 * 1024 * 256 * 4 and h.flops == 0

    def chain(c, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), c, w)[0]

    looped = jax.jit(chain, out_shardings=whole).lower(
        f32((16, 256), whole), f32((5, 256, 256), NamedSharding(mesh, P(None, "x")))).compile()
    h = aot.hlo_counts(looped.as_text(), 8)
    assert (h.loops, h.loops_unknown) == (1, 0)
    assert h.flops == 5 * 2 * 16 * 32 * 256  # 32 of the 256 contracted rows on each chip
    assert looped.cost_analysis()["flops"] < 2 * (2 * 16 * 32 * 256)  # one iteration (and its elementwise ops)
    result = 16 * 256 * 4
    assert h.collective_bytes["all-reduce"] == 5 * result and h.collective_bytes["all-gather"] == result
    assert h.ici_bytes == pytest.approx(5 * result * 2 * 7 / 8 + result * 7 / 8)


def test_abstract_batch_is_what_the_data_pipeline_hands_the_step(tiny_cfg, tmp_path):
    """Keys, shapes and dtypes of the global batch the step is compiled for equal the real pipeline's batches:
    pretraining windows, and packed fine-tuning rows."""
    mesh = sharding.make_mesh(-1, 1, 1)
    sft = load_config("finetune-quickstart", [f"data.cache_dir={tmp_path}", "train.batch_size=4"])
    for cfg in (tiny_cfg(), sft):
        tok = load_tokenizer(cfg.tokenizer, cfg.data)
        data = make_training_data(cfg.data, tok, batch_size=cfg.train.batch_size, seed=0, eval_batches=0)
        real = next(data.train_iter)
        data.close()
        abstract = aot.abstract_batch(cfg, cfg.train.batch_size, mesh)
        assert {k: (v.shape, np.dtype(v.dtype)) for k, v in abstract.items()} == {
            k: (np.shape(v), np.asarray(v).dtype) for k, v in real.items()}


# A tiny Llama (GQA: 4 query and 2 KV heads) trained by GRPO: 4 prompts x 4 completions of at most 24 new tokens.
GRPO = ["model.family=llama", "model.preset=tiny", "model.vocab_size=512", "data.format=prompts", "data.seq_len=96",
        "objective.name=grpo", "objective.prompts_per_step=8", "objective.num_generations=4",
        "objective.max_completion_length=24", "objective.rewards=[{name: exact_number, field: answer}]"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_plan_compiles_the_sampler_beside_the_step_and_splits_the_step_estimate(lora):
    """GRPO's plan compiles the run's batch-generation program (prefill and decode loop, LoRA sampled from merged
    weights) for the rollout's shapes, as the sampler buckets them. References: the model's KV cache shape (K and V,
    each layers x rows per chip x cache positions x KV heads x head dim), which the compiled decode loop must carry;
    the weights' bytes per chip, which are its arguments but for the prompts; the train
    step's model FLOPs counting the positions it computes (each prompt's group one row in regions: the prompt's
    72 slots once, then 4 completions of 24). The estimate is the stated formulas of those numbers."""
    cfg = load_config(None, [*GRPO, *(["model.lora.rank=4"] if lora else [])])
    d = aot.plan(cfg, "v5e-8")
    sp, chip = d["sampler"], aot.CHIPS["v5e"]
    # the buckets the sampler uses for its longest prompt (96 - 24 = 72 tokens at most): a power of two (128) would
    # leave no room in the 128-position context, so the prompt is 72 and the cache 128
    assert (sp["prompts"], sp["group"], sp["rows"], sp["prompt_len"], sp["cache_len"], sp["max_new_tokens"]) == (
        8, 4, 32, 72, 128, 24)
    model = info(cfg, devices=8)["model"]  # the tiny preset: 2 layers, 4 heads of 16, 2 KV heads, float32
    assert (model.n_layer, model.n_kv_head, model.d_model // model.n_head) == (2, 2, 16)
    # K and V, each (layers, rows per chip, positions, KV heads, head dim), as the compiled decode loop carries them:
    # the TPU compiler keeps the float32 cache in bfloat16 (its attention matmuls read it at default precision), and
    # this small, on chip (VMEM) rather than in HBM
    assert sp["kv_read_from_program"] and sp["kv_dtype"] == "bf16" and sp["kv_on_chip"]
    assert sp["kv_cache"] == 2 * (2 * 32 // 8 * 128 * 2 * 16) * 2
    prompts = 8 // 8 * 72 * (4 + 1)  # each chip's prompt row: tokens int32, valid bool
    # the TPU lays small arrays out in padded tiles (a (64,) norm scale takes a tile), so at this size XLA's
    # argument bytes exceed the logical ones by up to a quarter
    assert sp["weights"] + prompts <= sp["program"]["arguments"] <= 1.25 * (sp["weights"] + prompts)
    assert sp["lora_merged"] == lora and (sp["merged_kernels"] > 0) == lora
    assert sp["fits"] and sp["total"] > sp["resident"]
    e = d["estimate"]
    assert e["decode"] == pytest.approx(24 * (sp["weights"] + sp["kv_cache"]) / chip.hbm_bw)
    assert e["step"] == pytest.approx(e["generation"] + max(e["training_roofline"], e["training_at_mfu"]))
    spec_flops = info(cfg, devices=8)["flops_per_step"]
    assert d["roofline"]["model_flops"] == pytest.approx(spec_flops)  # 8 rows of 72 + 4 x 24 positions
    assert d["sequences"] == 4 and d["roofline"]["tokens_per_second"] == pytest.approx(
        8 * (72 + 4 * 24) / d["roofline"]["step_seconds"])
    assert spec_flops == pytest.approx(model.flops_per_token(96) * 8 * (72 + 4 * 24))
    text = aot.format_plan(d)
    assert "batch 8 prompts x 4 sequences x 96 tokens" in text
    assert "sampler:          8 prompts x 4 completions, prompts of 72 positions" in text
    assert "step estimate:    generation" in text and "% of it generating" in text
    assert_within_peaks(d)


def test_grpo_plan_says_what_sampling_ahead_would_save():
    """objective.max_staleness: on the learner's chips the estimate keeps the sequential step (only the host's work
    overlaps); with mesh.rollout=2 of 8 chips, generation on 2 (the weights whole on each, the KV cache over 2) and
    training on 6 are scaled from the slice's programs, and the step is the longer of the two."""
    shared = aot.plan(load_config(None, [*GRPO, "objective.max_staleness=1"]), "v5e-8")
    e = shared["estimate"]
    assert e["overlap"] == {"max_staleness": 1, "rollout_chips": 0, "step": e["step"]}
    assert "sampled ahead:    objective.max_staleness=1 on the learner's chips: the device time stays about" in \
        aot.format_plan(shared)
    split = aot.plan(load_config(None, [*GRPO, "objective.max_staleness=1", "mesh.rollout=2"]), "v5e-8")
    e, sp, chip = split["estimate"], split["sampler"], aot.CHIPS["v5e"]
    o = e["overlap"]
    assert o["generation"] == pytest.approx(e["prefill"] * 4 + 24 * (sp["weights_whole"] + sp["kv_cache"] * 4)
                                            / chip.hbm_bw)
    assert o["training"] == pytest.approx(max(e["training_roofline"], e["training_at_mfu"]) * 8 / 6)
    assert o["step"] == max(o["generation"], o["training"])
    assert sp["weights_whole"] == sp["weights"]  # data-parallel over the 8 chips: each holds the weights whole
    assert "sampled ahead:    objective.max_staleness=1, mesh.rollout=2: generation" in aot.format_plan(split)


def test_grpo_plan_compiles_each_reward_model_beside_the_step(tmp_path):
    """A reward model among GRPO's rewards is in the plan: its scoring program compiled for a step's 8 x 4
    completions at the widest bucket the run scores (72 prompt + 24 completion positions: 128, cut to the reward
    model's context of 64), its parameters those transformers counts, and its arguments its weights and the tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from helpers.trl_reference import word_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      pad_token_id=0, num_labels=1, tie_word_embeddings=False)
    model = transformers.LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path / "rm")
    word_tokenizer(64).save_pretrained(tmp_path / "rm")
    rewards = f"objective.rewards=[{{name: exact_number, field: answer}}, {{name: model, path: {tmp_path / 'rm'}}}]"
    d = aot.plan(load_config(None, [*GRPO, rewards]), "v5e-8")
    (rm,) = d["reward_models"]
    assert (rm["key"], rm["rows"], rm["width"]) == ("objective.rewards[1]", 32, 64)
    assert rm["params"] == sum(p.numel() for p in model.parameters())
    tokens = 32 * 64 * 4 + 32 * 4  # int32 tokens and last positions
    assert rm["weights"] + tokens <= rm["program"]["arguments"] <= 1.25 * (rm["weights"] + tokens) + 2**16
    assert rm["fits"] and rm["total"] > rm["resident"] > 0
    assert "reward model:     objective.rewards[1] (" in aot.format_plan(d)


@pytest.mark.slow
def test_grpo_longest_completion_fits_both_the_step_and_the_sampler():
    """For GRPO --max-seq searches the completion length after the run's prompt room (96 - 24 = 72 tokens), each
    candidate's train step and sampler compiled; here up to the model's context (600: completions of 512)."""
    p = aot.program(load_config(None, [*GRPO, "model.max_seq_len=600"]), "v5e-8")
    d = aot.longest_sequence(p, budget_seconds=900)
    assert d == {**d, "tokens": 512, "completion": True, "prompt_tokens": 72, "capped": True, "compiles": 2}
    (t1, ok1, m1), (t2, ok2, m2) = d["tried"]
    assert (t1, ok1, t2, ok2) == (256, True, 512, True) and m1 < m2
    assert aot.report._longest_line(d).startswith("longest completion: after prompts of 72 tokens, 512 tokens fit")


@pytest.mark.slow
def test_splash_kernel_compiles_for_v5e_and_v6e_under_a_mesh():
    """model.attention=splash on v5e-8 and v6e-8 with rows, parameters and heads split (data 2 x fsdp 2 x tensor 2):
    the TPU compiler builds the Pallas kernel (Mosaic custom calls: forward, dq and dkv per layer) into the train
    step, and the plan fits and says that its roofline cannot see inside them; XLA's attention has none."""
    base = ["model.family=llama", "model.preset=tiny", "model.vocab_size=512", "model.max_seq_len=1024",
            "data.seq_len=1024", "train.batch_size=8", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    calls = {}
    for attention, target in (("auto", "v5e-8"), ("splash", "v6e-8")):  # splash on v5e-8: the plan below
        cfg = load_config(None, [*base, f"model.attention={attention}"])
        p = aot.program(cfg, target)
        with sharding.use_mesh(p.mesh):
            lowered = p.steps.train.lower(p.steps.spec.abstract, aot.abstract_batch(cfg, 8, p.mesh),
                                          p.steps.abstract_frozen())
        calls[attention, target] = lowered.compile().as_text().count('custom_call_target="tpu_custom_call"')
    assert calls == {("auto", "v5e-8"): 0, ("splash", "v6e-8"): 2 * 3}
    d = aot.plan(load_config(None, [*base, "model.attention=splash"]), "v5e-8")
    # the kernels' matmuls are not in the HLO: the model's FLOPs stand in, so MFU stays a bound, never above 100%
    assert d["fits"] and d["roofline"]["kernels"] == 2 * 3 and 0 < d["roofline"]["mfu"] <= 1
    assert d["roofline"]["seconds"]["compute"] * 0.999 <= d["roofline"]["step_seconds"]
    assert "kernels:          6 Pallas kernel calls a step" in aot.format_plan(d)


def test_grpo_sampler_kv_cache_is_split_along_the_context_axis():
    """With mesh.context=8 each chip carries 1/8 of the KV cache's slots of all 32 rows: as many bytes as 4 whole
    rows under data=8, read from the compiled decode loop's buffers (their shape is the split one)."""
    from jaxtune.aot.sampler import compile_sampler

    base = [*GRPO, "data.max_prompt_length=16", "model.max_seq_len=512", "data.seq_len=272",
            "objective.max_completion_length=256"]
    kv = {}
    for mesh in (["mesh.data=8"], ["mesh.data=1", "mesh.context=8"]):
        sp = compile_sampler(aot.program(load_config(None, [*base, *mesh]), "v5e-8"))
        assert sp["kv_read_from_program"] and sp["cache_len"] == 512, mesh
        kv[mesh[-1]] = sp["kv_cache"]
    assert kv["mesh.context=8"] == kv["mesh.data=8"] == 2 * 2 * 4 * 512 * 2 * 16 * 2  # K, V x layers x rows ...


def test_grpo_sampler_memory_grows_with_the_group_and_the_completion_length():
    """The sampler's KV cache is rows x cache positions (the prompt fixed at 16 tokens by data.max_prompt_length): the
    buffers the compiled decode loop carries are the shapes computed by hand, doubling with num_generations (4 -> 8)
    and with the cache bucket that a longer completion needs (24 -> 56 new tokens: 64 -> 128 positions). (At this
    size the cache is on chip, so XLA's HBM numbers do not show it; a real model's is in HBM.)"""
    from jaxtune.aot.sampler import compile_sampler

    base = [*GRPO, "data.max_prompt_length=16"]
    plans = {(g, m): compile_sampler(aot.program(load_config(None, [*base, f"objective.num_generations={g}",
                                                                    f"objective.max_completion_length={m}"]), "v5e-8"))
             for g, m in ((4, 24), (8, 24), (4, 56))}  # the sampler alone (no train step compiled)
    per_position = 2 * 2 * 2 * 16 * 2  # K and V x 2 layers x 2 KV heads x head dim 16, bfloat16 in the program
    for (g, m), sp in plans.items():
        cache = 64 if m == 24 else 128
        assert (sp["prompt_len"], sp["cache_len"], sp["rows"]) == (16, cache, 8 * g)
        assert sp["kv_read_from_program"] and sp["kv_cache"] == 8 * g // 8 * cache * per_position
    small = plans[4, 24]
    for bigger in (plans[8, 24], plans[4, 56]):
        assert bigger["kv_cache"] == 2 * small["kv_cache"]


@pytest.mark.parametrize("name, says", [
    ("v5e-6", "v5e slice sizes count chips; the slices are v5e-1, v5e-4, v5e-8"),
    ("v5p-6", "v5p slice sizes count TensorCores, 2 per chip"),
    ("v7-8", "not a Cloud TPU slice name"),
    ("tpu", "not a Cloud TPU slice name"),
])
def test_unknown_slice_names_are_errors(name, says):
    with pytest.raises(ConfigError, match=says):
        aot.tpu_slice(name)


@pytest.mark.parametrize("name, chips, topology", [
    ("v5e-8", 8, "v5e:2x4"), ("v5litepod-16", 16, "v5e:4x4"), ("v6e-256", 256, "v6e:16x16"),
    ("v4-8", 4, "v4:2x2x1"), ("v5p-128", 64, "v5p:4x4x4"), ("v5p-8", 4, "v5p:2x2x1"),
])
def test_slice_names_map_to_chips_and_topologies(name, chips, topology):
    """v4 and v5p names count TensorCores (2 per chip), v5e and v6e names count chips; libtpu makes one device per
    chip of each."""
    s = aot.tpu_slice(name)
    assert (s.chips, s.topology) == (chips, topology)
    assert len(aot.slice_devices(s)) == chips


def test_a_mesh_that_does_not_divide_the_slice_is_an_error():
    cfg = load_config("gpt2-124m", [*SMALL, "mesh.data=3", "mesh.fsdp=1", "mesh.tensor=1"])
    with pytest.raises(sharding.ShardingError, match=r"--compile-for v5e-8 \(8 chips\): mesh.data"):
        aot.plan(cfg, "v5e-8")


def test_a_batch_that_does_not_split_over_the_slice_is_an_error():
    cfg = load_config("gpt2-124m", [*SMALL, "train.batch_size=24", "train.micro_batches=2"])
    with pytest.raises(sharding.ShardingError, match=r"train.batch_size=24: on v5e-8 it must be a multiple of 16"):
        aot.plan(cfg, "v5e-8")


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # what an environment without the package gives
    with pytest.raises(ConfigError, match=r"pip install 'jaxtune\[aot\]'"):
        aot.slice_devices(aot.tpu_slice("v5e-8"))


def test_cli_prints_the_plan_and_json(capsys):
    """`jaxtune info CONFIG --compile-for SLICE key=value ...`: the analytic plan for the slice's chips, then the
    compiled one; --json gives the same numbers to scripts."""
    small = [*SMALL, "train.batch_size=32", "train.micro_batches=1"]
    assert main(["info", "gpt2-124m", "--compile-for", "v5e-8", *small]) == 0
    out = capsys.readouterr().out
    assert "over 8 device(s)" in out  # the analytic part, for the slice's chips
    for line in ("compiled for:     v5e-8: 8 chips of TPU v5 lite (topology v5e:2x4)", "usable HBM: fits",
                 "FLOPs / chip:", "collectives:      all-reduce", "roofline:", "MFU"):
        assert line in out
    assert main(["info", "gpt2-124m", "--json", "--compile-for", "v5e-8", *small]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compiled"]["fits"] and d["info"]["devices"] == 8 and d["compiled"]["roofline"]["bound"]
    assert main(["info", "gpt2-124m", "--compile-for", "v9-8"]) == 2
    assert "not a Cloud TPU slice name" in capsys.readouterr().err
    assert main(["info", "gpt2-124m", "--max-batch"]) == 2
    assert "add --compile-for SLICE" in capsys.readouterr().err
    assert main(["info", "gpt2-124m", "--max-seq"]) == 2
    assert "--max-seq searches by compiling for a TPU slice" in capsys.readouterr().err


@pytest.mark.parametrize("recipe, overrides, says", [
    ("quickstart", [],
     ("--max-seq searches data.seq_len in steps of 256 tokens, up to the model's context of 128 tokens "
      "(model.max_seq_len), which holds no step: the run's own data.seq_len=128 is planned without --max-seq (drop "
      "it), or raise model.max_seq_len to at least 256 to search")),
    ("grpo-quickstart", ["model.from_hf=null", "model.family=llama", "model.preset=tiny", "model.max_seq_len=128"],
     ("--max-seq searches objective.max_completion_length in steps of 256 tokens, after the prompts' 64 tokens "
      "(data.seq_len=96 - objective.max_completion_length=32), up to the model's context of 128 tokens "
      "(model.max_seq_len), which holds no step: the run's own data.seq_len=96 is planned without --max-seq (drop "
      "it), or raise model.max_seq_len to at least 320 to search")),
], ids=["seq_len", "grpo-completion"])
def test_max_seq_on_a_context_under_one_step_is_one_line_naming_the_recipes_keys(capsys, recipe, overrides, says):
    """A recipe whose context is under the search's 256-token step (quickstart's 128): one line naming its own
    keys and values, before anything is compiled (it named a data.seq_len of 256 or 320 the recipe does not have)."""
    assert main(["info", recipe, *overrides, "--compile-for", "v5e-8", "--max-seq"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {says}\n" and "Traceback" not in captured.err
    assert "compiled for:" not in captured.out


def test_libtpu_stays_quiet_and_shareable_on_a_cpu_host():
    """With libtpu installed and no TPU device file, another JAX process on the host (here one that never heard of
    jaxtune, holding libtpu's lock file as any JAX process does) does not stop a plan from creating a TPU topology,
    and the plan's process prints none of libtpu's warnings."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE",
                                                            "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    hold = "import jax, sys; jax.devices(); print('up', flush=True); sys.stdin.read()"
    other = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert other.stdout.readline().strip() == "up"
        topo = "from jaxtune import aot; print(len(aot.slice_devices(aot.tpu_slice('v5e-8'))))"
        plan = subprocess.run([sys.executable, "-c", topo], capture_output=True, text=True, timeout=120, env=env,
                              check=False)
    finally:
        other.communicate("", timeout=60)
    assert plan.returncode == 0 and plan.stdout.strip() == "8", plan.stderr
    assert "TPU_ACCELERATOR_TYPE" not in plan.stderr and "TPU_WORKER_HOSTNAMES" not in plan.stderr, plan.stderr


@pytest.mark.slow
def test_the_docs_plan_table_is_a_fresh_plan():
    """docs/scale-out.md's gemma3-1b-grpo row on v5e-8 (written by `benchmarks/tpu_plan.py --write`) against its train
    step compiled now: memory per chip, the roofline step, MFU and tokens/s within 5% (what another libtpu or a
    changed program moves; the 3x of a stale row is far outside), the bound the same. The sampler is not compiled
    here: its numbers come from the same plan. Within the peaks as every plan."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import tpu_plan
    finally:
        sys.path.remove(str(root / "benchmarks"))
    _, cells = tpu_plan.doc_row((root / "docs" / "scale-out.md").read_text(), "gemma3-1b-grpo", "v5e-8")
    memory, step, bound, mfu, tokens = cells[4], cells[5], cells[6], cells[7], cells[8]
    p = aot.program(load_config("gemma3-1b-grpo"), "v5e-8")
    r = p.compile(p.cfg.train.batch_size)
    rl = aot.roofline(p, r)
    assert r["memory"]["total"] / aot.GiB == pytest.approx(float(memory.split(" /")[0]), rel=0.05, abs=0.05)
    assert 1e3 * rl["step_seconds"] == pytest.approx(float(step.removesuffix(" ms")), rel=0.05)
    assert rl["bound"] == bound
    assert 100 * rl["mfu"] == pytest.approx(float(mfu.removesuffix("%")), rel=0.05)
    assert rl["tokens_per_second"] == pytest.approx(float(tokens.replace(",", "")), rel=0.05)
    assert_within_peaks({"slice": {"chips": p.slice.chips, "peak_flops": p.slice.chip.peak_flops,
                                   "hbm_bw": p.slice.chip.hbm_bw},
                         "roofline": rl, "flops_per_chip": r["hlo"].flops, "hbm_bytes_per_chip": r["hlo"].bytes})
