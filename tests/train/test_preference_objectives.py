"""Preference objectives (`jaxtune.train.objectives.preference`) against TRL 1.16.0's own code, on a tiny random
fp32 `LlamaForCausalLM` saved with ``save_pretrained`` and read by jaxtune (``model.from_hf``), with hand-made pairs
of different prompt and completion lengths laid out as the data pipeline lays them out (`PairRows`).

The TRL side is TRL's code: a real `DPOTrainer` (its collator, its ``compute_loss``, its ``_metrics``), and
``CPOTrainer.get_batch_loss_metrics`` (``loss_type="simpo"``, ``cpo_alpha=0``) and
``ORPOTrainer.get_batch_loss_metrics`` called on an instance built without ``__init__`` (only the attributes those
methods read). The policy is the saved model plus noise (both sides read the same perturbed checkpoint); DPO's
reference is the unperturbed one, so the rewards are not zero. DPOConfig's ``bf16`` is turned off: its default
(True, even on CPU) runs the reference model under bf16 autocast.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|, float32 on both sides. Two metrics are differences that
nearly cancel on a random model, so their error is measured against the larger operand: ``rewards/margins``
|ours - ref| / max(|ref|, |rewards/chosen|, |rewards/rejected|), and ORPO's ``log_odds_chosen`` (log odds(chosen) -
log odds(rejected)) the same with ``logps/chosen`` and ``logps/rejected``. Tolerances:
  * DPO, every TRL 1.16 loss type (sigmoid, ipo, hinge, robust, bco_pair, sppo_hard, nca_pair, aot,
    aot_unpaired, apo_zero, apo_down, exo_pair, discopop, sigmoid_norm; sft on chosen completions of one length)
    and a weighted list (MPO) vs DPOTrainer (full fine-tuning, reference = a frozen copy):
      loss, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected   rel <= 1e-5
      rewards/accuracies                                                                       equal (float32)
      gradients of the embedding, a q_proj, an mlp down_proj, the final norm and lm_head       rel <= 1e-5
  * DPO label smoothing e = 0.2 (TRL 1.16's sigmoid has none): vs -(1-e) log s(bD) - e log s(-bD) on PyTorch's
    sequence log-probs of the same checkpoints, loss and gradients                             rel <= 1e-5
    (that closed form at e = 0 vs DPOTrainer's loss                                            rel <= 1e-5)
  * SimPO (label smoothing 0.1) vs CPOTrainer: loss, metrics, gradients                        as DPO
  * ORPO vs ORPOTrainer on one-token prompts with chosen completions of one length: loss,
    every metric (nll_loss, log_odds_ratio, log_odds_chosen too), gradients                    as DPO
  * ORPO with longer prompts: the odds-ratio term and every metric but nll_loss                as DPO; the NLL terms
    differ by design: TRL's is the cross-entropy over the chosen rows' prompt *and* completion tokens (checked by
    hand, rel <= 1e-5), ours the chosen completion's (the ORPO paper's SFT term)
  * LoRA's reference (adapters off) vs the same checkpoint without LoRA, native and torchax:
    token log-probs                                                                            bitwise equal
  * a padding pair (all zeros) at the end of a batch: counted 0, everything finite, and loss, metrics and gradients
    (dpo, simpo, orpo) equal TRL's on the batch without it                                     as above
  * a DPO train step (LoRA: adapters off; full fine-tuning: a copy) over 3 steps               traced once

XLA's CPU compiles dominate the run time, so one spec serves every full fine-tuning check (the objective is not part
of a spec), each objective's loss-and-gradient function is compiled once, for batches of 4 pairs, and without LLVM's
optimisations (``xla_backend_optimization_level=0``: the same operations, compiled in a third of the time). The
bitwise reference check and the train steps are compiled as training compiles them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import trl_reference
from helpers.compare import rel
from helpers.trl_reference import BOS, GRAD_PARAMS, MESH, TOL, TRL_VERSION, Native, Ours, TRLResult, hf_grads, hf_model

from jaxtune import sharding
from jaxtune.config import objective_config
from jaxtune.data.encoded import Encoded
from jaxtune.data.preference import PairRows
from jaxtune.train.objectives import make_objective
from jaxtune.train.objectives.preference import flat_pairs
from jaxtune.train.reference import AdaptersOff, Frozen, FrozenCopy, step_reference
from jaxtune.train.step import jit_steps

torch = pytest.importorskip("torch", reason="the TRL comparisons run PyTorch")
trl = pytest.importorskip("trl", reason="the preference objectives are checked against TRL's code")
datasets = pytest.importorskip("datasets", reason="DPOTrainer takes a datasets.Dataset")

V, T = 100, 12  # vocabulary; positions per sequence (the longest pair below needs 9)
# (prompt, chosen, rejected) token ids: prompts of 2 to 6 tokens, completions of 2 to 6, each ending in EOS.
PAIRS = [
    ([BOS, 5, 9, 14], [22, 31, 2], [40, 2]),
    ([BOS, 7], [11, 12, 13, 14, 2], [50, 51, 2]),
    ([BOS, 60, 61, 62, 63, 64], [70, 2], [71, 72, 73, 2]),
    ([BOS, 3, 4], [80, 81, 82, 2], [90, 91, 92, 93, 94, 2]),
]
# One-token prompts and chosen completions of one length: where TRL's ORPO NLL (a token mean over the chosen rows,
# prompt included) is our mean over pairs of each chosen completion's mean.
ORPO_EQUAL = [
    ([BOS], [20, 21, 22, 2], [30, 2]),
    ([BOS], [23, 24, 25, 2], [31, 32, 33, 34, 2]),
    ([BOS], [26, 27, 28, 2], [35, 36, 2]),
    ([BOS], [41, 42, 43, 2], [44, 45, 46, 47, 48, 2]),
]
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
ORPO_METRICS = (*REWARDS, "nll_loss", "log_odds_ratio", "log_odds_chosen")


# Metrics that are differences of two others (chosen minus rejected): their error is measured against the larger
# operand, as float32 cannot do better when they nearly cancel.
DIFFERENCES = {"rewards/margins": ("rewards/chosen", "rewards/rejected"),
               "log_odds_chosen": ("logps/chosen", "logps/rejected")}


def metric_error(k: str, ours: dict[str, float], theirs: dict[str, float]) -> float:
    scale = max([abs(theirs[k]), *(abs(theirs[o]) for o in DIFFERENCES.get(k, ()))])
    return abs(ours[k] - theirs[k]) / scale


# ---------------------------------------------------------------------------------------------------- checkpoints


# One PyTorch thread while this module runs (see trl_reference.one_torch_thread).
torch_one_thread = pytest.fixture(scope="module", autouse=True)(trl_reference.one_torch_thread)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"ref": a random tiny Llama, "policy": the same plus noise}, each a save_pretrained directory."""
    return trl_reference.save_checkpoints(tmp_path_factory.mktemp("preference"), V, {"policy": 0.05})


# ---------------------------------------------------------------------------------------------------- TRL side


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer (w3 .. w99): DPOTrainer tokenizes its dataset with it; the compared batches are
    collated from the token ids above."""
    return trl_reference.word_tokenizer(V)


def trl_dpo(checkpoints, tokenizer, tmp_path, pairs, **config) -> TRLResult:
    """DPOTrainer (perturbed policy, the unperturbed checkpoint its reference model): ``compute_loss`` on its own
    collation of ``pairs``, the metrics it logged, the policy's gradients."""
    from trl import DPOConfig, DPOTrainer

    assert trl.__version__ == TRL_VERSION, f"these comparisons were written against TRL {TRL_VERSION}"
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4"], "chosen": [" w5"], "rejected": [" w6"]})
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(pairs), **config)
    trainer = DPOTrainer(model=hf_model(checkpoints["policy"]), ref_model=hf_model(checkpoints["ref"]), args=args,
                         train_dataset=data, processing_class=tokenizer)
    trainer.model.train()  # _compute_loss logs under "train" in train mode (dropout is 0 either way)
    batch = trainer.data_collator([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return TRLResult(loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}, hf_grads(trainer.model))


def paired_batch(pairs) -> dict[str, torch.Tensor]:
    """The CPO / ORPO trainers' batch: {chosen,rejected}_{input_ids,attention_mask,labels}, right-padded, labels
    -100 on the prompt and the padding (as their ``tokenize_row`` and collator make them)."""
    out = {}
    for side, k in (("chosen", 1), ("rejected", 2)):
        seqs = [pair[0] + pair[k] for pair in pairs]
        width = max(map(len, seqs))
        ids = torch.zeros(len(pairs), width, dtype=torch.long)
        mask = torch.zeros(len(pairs), width, dtype=torch.long)
        labels = torch.full((len(pairs), width), -100, dtype=torch.long)
        for i, (pair, seq) in enumerate(zip(pairs, seqs)):
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
            labels[i, len(pair[0]):len(seq)] = torch.tensor(pair[k])
        out |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    return out


def trl_unbound(checkpoints, cls, pairs, **attrs) -> TRLResult:
    """``cls.get_batch_loss_metrics`` on the perturbed policy, from an instance built without ``__init__``: the
    attributes its loss methods read, nothing else."""
    assert trl.__version__ == TRL_VERSION, f"these comparisons were written against TRL {TRL_VERSION}"
    trainer = cls.__new__(cls)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    trainer.__dict__.update(is_encoder_decoder=False, aux_loss_enabled=False, accelerator=accelerator, **attrs)
    model = hf_model(checkpoints["policy"])
    loss, metrics = trainer.get_batch_loss_metrics(model, paired_batch(pairs))
    loss.backward()
    return TRLResult(loss.item(), metrics, hf_grads(model))


def trl_simpo(checkpoints, pairs, beta, gamma, eps) -> TRLResult:
    from trl.experimental.cpo import CPOTrainer

    return trl_unbound(checkpoints, CPOTrainer, pairs, beta=beta, simpo_gamma=gamma, label_smoothing=eps,
                       loss_type="simpo", alpha=0.0, cpo_alpha=0.0, pad_token_id=0)


def trl_orpo(checkpoints, pairs, beta) -> TRLResult:
    from trl.experimental.orpo import ORPOTrainer

    return trl_unbound(checkpoints, ORPOTrainer, pairs, beta=beta, padding_value=0)


# ---------------------------------------------------------------------------------------------------- jaxtune side


# A DPO run, full fine-tuning, batches of 4 pairs.
DPO_RUN = ("objective.name=dpo", "data.format=preference", "data.sources=[pairs.jsonl]", f"data.seq_len={T}",
           "train.batch_size=4", "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=3")


def spec_for(model_dir, *overrides: str):
    """(config, spec) of a DPO run from ``model_dir`` (``model.from_hf``) on a one-device mesh."""
    return trl_reference.tiny_spec(model_dir, *DPO_RUN, *overrides)


@pytest.fixture(scope="module")
def native(checkpoints) -> Native:
    return Native.of(checkpoints, *DPO_RUN)


def ours(native: Native, pairs, name: str, empty_pairs: int = 0, **keys) -> Ours:
    """``objective.name=name`` (with ``keys``) on the policy as the train step forms it: `objective_loss`'s sums
    and their gradients, divided by the objective's count. DPO's reference is the unperturbed checkpoint, as the
    frozen copy (the last frozen group). ``empty_pairs``: padding pairs (all zeros) after ``pairs``."""
    cfg = objective_config(name=name, **keys)
    batch = pair_batch(pairs)
    batch = {k: np.concatenate([v, np.zeros((empty_pairs, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    means = lambda metrics, count: {k: float(v) / float(count) for k, v in metrics.items()}
    return trl_reference.objective_result(native, make_objective(cfg), cfg, native.policy, batch, means)


def pair_batch(pairs) -> dict[str, np.ndarray]:
    """``pairs`` as the data pipeline lays them out: (B, 2, T) arrays of `PairRows` (right-padded, segment 0)."""
    encoded = []
    for prompt, chosen, rejected in pairs:
        encoded.append(tuple(Encoded(np.array(prompt + c, np.int32), np.array([0] * len(prompt) + [1] * len(c), bool))
                             for c in (chosen, rejected)))
    rows = PairRows.of(encoded, T)
    return {k: np.stack([rows[i][k] for i in range(len(rows))]) for k in rows[0]}


def assert_matches(mine: Ours, theirs: TRLResult, names=REWARDS, grads: bool = True) -> dict[str, float]:
    """Loss, ``names`` metrics, rewards/accuracies (and the gradients) as the tolerances above; the errors."""
    errors = trl_reference.assert_close(mine, theirs, names, metric_error, grads)
    assert np.float32(mine.metrics["rewards/accuracies"]) == np.float32(theirs.metrics["rewards/accuracies"])
    return errors


# ---------------------------------------------------------------------------------------------------- DPO


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("ipo", 0.5), ("hinge", 1.0)])
def test_dpo_matches_trl_dpo_trainer(checkpoints, tokenizer, native, tmp_path, loss_type, beta):
    """Full fine-tuning: our loss, TRL's reward metrics and the gradients equal DPOTrainer's on the same pairs."""
    theirs = trl_dpo(checkpoints, tokenizer, tmp_path, PAIRS, loss_type=[loss_type], beta=beta)
    mine = ours(native, PAIRS, "dpo", loss_type=loss_type, beta=beta)
    assert mine.count == len(PAIRS)
    assert 0.0 < theirs.metrics["rewards/accuracies"] < 1.0  # rewards of both signs: the policy is not the reference
    if loss_type == "hinge":  # some pairs past the margin (no loss, no gradient), some not
        assert 0.0 < theirs.loss < 1.0
    assert_matches(mine, theirs)


# TRL 1.16's other DPO loss types, each with the keys it reads (label smoothing where TRL uses it; exo_pair needs
# it > 0). sft is TRL's token mean over the batch's chosen completions, ours each pair's mean: equal on chosen
# completions of one length (ORPO_EQUAL). aot and aot_unpaired sort the batch's pairs.
MORE_LOSS_TYPES = [
    ("robust", {"beta": 0.5, "label_smoothing": 0.1}, PAIRS),
    ("bco_pair", {"beta": 0.5}, PAIRS),
    ("sppo_hard", {"beta": 0.5}, PAIRS),
    ("nca_pair", {"beta": 0.5}, PAIRS),
    ("aot", {"beta": 0.5, "label_smoothing": 0.1}, PAIRS),
    ("aot_unpaired", {"beta": 0.5}, PAIRS),
    ("apo_zero", {"beta": 0.5}, PAIRS),
    ("apo_down", {"beta": 0.5}, PAIRS),
    ("exo_pair", {"beta": 0.5, "label_smoothing": 1e-3}, PAIRS),
    ("discopop", {"beta": 0.5, "discopop_tau": 0.05}, PAIRS),
    ("sigmoid_norm", {"beta": 0.5}, PAIRS),
    ("sft", {"beta": 0.1}, ORPO_EQUAL),
    (["sigmoid", "bco_pair", "sft"], {"beta": 0.1, "loss_weights": [0.8, 0.2, 1.0]}, ORPO_EQUAL),  # MPO
]


@pytest.mark.parametrize("loss_type, keys, pairs", MORE_LOSS_TYPES,
                         ids=[t if isinstance(t, str) else "+".join(t) for t, _, _ in MORE_LOSS_TYPES])
def test_dpo_loss_types_match_trl_dpo_trainer(checkpoints, tokenizer, native, tmp_path, loss_type, keys, pairs):
    """Every other loss type of TRL 1.16's DPOTrainer, and a weighted list of them (MPO's sigmoid + bco_pair +
    sft): loss, reward metrics and gradients as DPOTrainer's, the tolerances above."""
    types = loss_type if isinstance(loss_type, list) else [loss_type]
    theirs = trl_dpo(checkpoints, tokenizer, tmp_path, pairs, loss_type=types, **keys)  # DPOConfig's own keys
    mine = ours(native, pairs, "dpo", loss_type=loss_type, **keys)
    assert mine.count == len(pairs) and np.isfinite(theirs.loss) and theirs.loss != 0
    assert_matches(mine, theirs)


def sequence_logps(model, pairs) -> torch.Tensor:
    """(B, 2) summed completion log-probs from the model's logits, plain PyTorch (no TRL)."""
    out = []
    for prompt, chosen, rejected in pairs:
        row = []
        for completion in (chosen, rejected):
            ids = torch.tensor([prompt + completion])
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            targets = ids[0, 1:]
            row.append(logps[torch.arange(len(targets)), targets][len(prompt) - 1:].sum())
        out.append(torch.stack(row))
    return torch.stack(out)


def test_dpo_label_smoothing_is_conservative_dpo(checkpoints, tokenizer, native, tmp_path):
    """objective.label_smoothing=e: -(1-e) log s(bD) - e log s(-bD) on PyTorch's sequence log-probs of the same
    checkpoints (loss and gradients); at e = 0 that closed form is DPOTrainer's sigmoid loss."""
    beta, eps = 0.1, 0.2
    policy, ref = hf_model(checkpoints["policy"]), hf_model(checkpoints["ref"])
    with torch.no_grad():
        ref_logps = sequence_logps(ref, PAIRS)

    def closed_form(e):
        ratios = sequence_logps(policy, PAIRS) - ref_logps
        z = beta * (ratios[:, 0] - ratios[:, 1])
        return (-(1 - e) * torch.nn.functional.logsigmoid(z) - e * torch.nn.functional.logsigmoid(-z)).mean()

    trl_loss = trl_dpo(checkpoints, tokenizer, tmp_path, PAIRS, loss_type=["sigmoid"], beta=beta).loss
    assert rel(closed_form(0.0).item(), trl_loss) <= TOL

    expected = closed_form(eps)
    expected.backward()
    mine = ours(native, PAIRS, "dpo", beta=beta, label_smoothing=eps)
    assert rel(mine.loss, expected.item()) <= TOL, (mine.loss, expected.item())
    assert abs(mine.loss - trl_loss) > 1e-2  # the smoothing is felt
    expected_grads = hf_grads(policy)
    for path, (name, _) in GRAD_PARAMS.items():
        assert rel(trl_reference.our_grad(mine.grads, path), expected_grads[name]) <= TOL, name


# ---------------------------------------------------------------------------------------------------- SimPO, ORPO

SIMPO = {"beta": 2.0, "gamma": 0.5, "label_smoothing": 0.1}


def test_simpo_matches_trl_cpo_trainer(checkpoints, native):
    """objective.name=simpo vs CPOTrainer(loss_type="simpo", cpo_alpha=0): TRL's SimPO on average log-probs, with
    label smoothing (whose e = 0 is plain SimPO)."""
    theirs = trl_simpo(checkpoints, PAIRS, SIMPO["beta"], SIMPO["gamma"], SIMPO["label_smoothing"])
    mine = ours(native, PAIRS, "simpo", **SIMPO)
    assert mine.count == len(PAIRS)
    assert 0.0 < theirs.metrics["rewards/accuracies"] < 1.0
    assert_matches(mine, theirs)


def test_orpo_matches_trl_orpo_trainer(checkpoints, native):
    """One-token prompts, chosen completions of one length: the full ORPO loss, its metrics (nll_loss,
    log_odds_ratio, log_odds_chosen included) and the gradients equal ORPOTrainer's."""
    theirs = trl_orpo(checkpoints, ORPO_EQUAL, 0.1)
    mine = ours(native, ORPO_EQUAL, "orpo", beta=0.1)
    assert mine.count == len(ORPO_EQUAL)
    assert_matches(mine, theirs, names=ORPO_METRICS)


def test_orpo_odds_ratio_matches_trl_and_nll_is_the_completions(checkpoints, native):
    """Longer prompts: the odds-ratio term and the reward metrics equal ORPOTrainer's; the NLL terms differ by
    design. TRL's is the cross-entropy over every token of the chosen rows after the first, prompt included (checked
    here by hand); ours is the mean over each chosen completion, averaged over pairs (the ORPO paper's SFT term)."""
    theirs = trl_orpo(checkpoints, PAIRS, 0.1)
    mine = ours(native, PAIRS, "orpo", beta=0.1)
    odds_term = SimpleNamespace(loss=theirs.loss - theirs.metrics["nll_loss"], metrics=theirs.metrics)
    assert_matches(Ours(mine.loss - mine.metrics["nll_loss"], mine.count, mine.metrics, None), odds_term,
                   names=(*REWARDS, "log_odds_ratio", "log_odds_chosen"), grads=False)

    model = hf_model(checkpoints["policy"])
    batch = paired_batch(PAIRS)
    with torch.no_grad():
        logits = model(batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits[:, :-1]
    targets = batch["chosen_input_ids"][:, 1:].masked_fill(batch["chosen_attention_mask"][:, 1:] == 0, -100)
    prompt_and_completion = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).item()
    assert rel(theirs.metrics["nll_loss"], prompt_and_completion) <= TOL
    assert rel(mine.metrics["nll_loss"], -mine.metrics["logps/chosen"]) <= TOL  # ours: the completions' mean NLL
    assert abs(mine.metrics["nll_loss"] - theirs.metrics["nll_loss"]) > 1e-2


# ---------------------------------------------------------------------------------------------------- padding


def test_padding_pair_counts_nothing(checkpoints, tokenizer, native, tmp_path):
    """A padding pair (no completion token, as `make_sequence_batches` fills the last held-out batch) is not a pair:
    with one after 3 pairs, 3 are counted, everything is finite, and loss, metrics and gradients equal TRL's on the 3
    pairs alone, for dpo, simpo and orpo (each compiled for 4 pairs once, by the tests above)."""
    cases = [
        ("dpo", PAIRS[:3], {"beta": 0.1}, REWARDS,
         lambda: trl_dpo(checkpoints, tokenizer, tmp_path, PAIRS[:3], loss_type=["sigmoid"], beta=0.1)),
        ("simpo", PAIRS[:3], SIMPO, REWARDS,
         lambda: trl_simpo(checkpoints, PAIRS[:3], SIMPO["beta"], SIMPO["gamma"], SIMPO["label_smoothing"])),
        ("orpo", ORPO_EQUAL[:3], {"beta": 0.1}, ORPO_METRICS, lambda: trl_orpo(checkpoints, ORPO_EQUAL[:3], 0.1)),
        # aot sorts the batch's pairs: a padding pair must not take part
        ("dpo", PAIRS[:3], {"beta": 0.5, "loss_type": "aot", "label_smoothing": 0.1}, REWARDS,
         lambda: trl_dpo(checkpoints, tokenizer, tmp_path, PAIRS[:3], loss_type=["aot"], beta=0.5,
                         label_smoothing=0.1)),
    ]
    for name, pairs, keys, names, theirs in cases:
        mine = ours(native, pairs, name, empty_pairs=1, **keys)
        assert mine.count == 3, name
        assert np.isfinite(mine.loss) and all(np.isfinite(v) for v in mine.metrics.values()), name
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(mine.grads)), name
        assert_matches(mine, theirs(), names=names)


# ---------------------------------------------------------------------------------------------------- reference


@pytest.fixture(scope="module")
def lora_native(checkpoints):
    """A native LoRA (rank 4) run on the unperturbed checkpoint: (config, spec)."""
    return spec_for(checkpoints["ref"], "model.lora.rank=4")


def _token_logps(forward, weights, rows) -> np.ndarray:
    with sharding.use_mesh(MESH):
        return np.asarray(jax.jit(forward.token_logps)(weights, rows))


@pytest.mark.parametrize("backend", ["native", "torchax"])
def test_lora_reference_is_the_base_model_exactly(checkpoints, native, lora_native, backend):
    """With LoRA the reference is the base with the adapters off (no copy): the token log-probs the step's reference
    gives are bitwise those of the same checkpoint without LoRA, while the adapted model's (adapters made nonzero)
    differ; and the reference knows the policy as itself while B = 0 only."""
    if backend == "native":
        cfg, spec = lora_native
        plain = (native.spec.forward(), native.ref)
    else:
        cfg, spec = spec_for(checkpoints["ref"], "model.backend=torchax", "model.lora.rank=4")
        plain_spec = spec_for(checkpoints["ref"], "model.backend=torchax")[1]
        plain = (plain_spec.forward(), plain_spec.init(0).params)
    reference = step_reference(spec, cfg.objective)
    assert isinstance(reference, AdaptersOff)
    frozen = Frozen(spec.load_frozen(0))
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), spec.init(0).params)
    rows = {k: jnp.asarray(v) for k, v in flat_pairs(pair_batch(PAIRS)).items()}

    base = _token_logps(*plain, rows)
    with sharding.use_mesh(MESH):
        off = np.asarray(jax.jit(lambda fr, r: reference.logps(fr)(r))(frozen, rows))
        same = jax.jit(lambda params, fr: reference.bind(params, fr).is_policy)
        assert bool(same(spec.init(0).params, frozen)) and not bool(same(adapters, frozen))
    on = _token_logps(spec.forward(), spec.weights(adapters, frozen.model), rows)
    assert np.array_equal(off, base)
    assert np.abs(on - base).max() > 1e-3


# ---------------------------------------------------------------------------------------------------- step


@pytest.mark.parametrize("lora", [True, False], ids=["lora-adapters-off", "full-copy"])
def test_dpo_train_step_compiles_once(checkpoints, lora_native, lora):
    """The jitted DPO train step, its reference LoRA's base (adapters off) or a frozen copy, is traced once over 3
    steps. The policy starts as its reference (LoRA's B = 0; the copy), so the first loss is log 2 and no reward
    moves; then it learns."""
    cfg, spec = lora_native if lora else spec_for(checkpoints["ref"])
    reference = step_reference(spec, cfg.objective)
    assert isinstance(reference, FrozenCopy) is not lora
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train, reference)
    state = spec.init(0)
    frozen = steps.frozen(spec.load_frozen(0), 0)
    # LoRA: the base and no weights of the companion's; full fine-tuning: no base, the copy
    assert (len(frozen.model), frozen.companion is None) == ((1, True) if lora else (0, False))
    batch = pair_batch(PAIRS)
    losses = []
    with sharding.use_mesh(MESH):
        for _ in range(3):
            state, m = steps.train(state, sharding.global_batch(MESH, batch), frozen)
            m = jax.device_get(m)
            losses.append(float(m["loss"]))
            if len(losses) == 1:
                assert abs(losses[0] - math.log(2)) <= 1e-6 and float(m["rewards/margins"]) == 0.0
                assert float(m["count"]) == len(PAIRS)
    assert steps.compiles == 1
    assert losses[-1] < losses[0] - 1e-3, losses


# ---------------------------------------------------------------------------------------------------- KTO
# KTO (`jaxtune.train.objectives.kto`) vs TRL 1.16's KTOTrainer (a real trainer, its collator, ``compute_loss``,
# ``_metrics``): unpaired rows of the same ids, each with its KL completion the previous row's (TRL's rotation by one
# within the batch, as `jaxtune.data.unpaired` makes them). Loss, rewards/chosen, rewards/rejected, logps/chosen,
# logps/rejected, kl and gradients: rel <= 1e-5 (kl: equal when TRL's clamp makes it 0).

# (prompt, completion, label): 2 desirable, 2 undesirable, of different lengths
UNPAIRED = [
    ([BOS, 5, 9, 14], [22, 31, 2], True),
    ([BOS, 7], [11, 12, 13, 14, 2], False),
    ([BOS, 60, 61, 62, 63, 64], [70, 2], True),
    ([BOS, 3, 4], [80, 81, 82, 2], False),
]
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def trl_kto(checkpoints, tokenizer, tmp_path, rows, **config) -> TRLResult:
    from trl import KTOConfig, KTOTrainer

    assert trl.__version__ == TRL_VERSION, f"these comparisons were written against TRL {TRL_VERSION}"
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4", "w5"], "completion": [" w5", " w6"],
                                       "label": [True, False]})
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(rows), train_sampling_strategy="sequential", **config)
    trainer = KTOTrainer(model=hf_model(checkpoints["policy"]), ref_model=hf_model(checkpoints["ref"]), args=args,
                         train_dataset=data, processing_class=tokenizer)
    trainer.model.train()
    completions = [c for _, c, _ in rows]
    kl = [completions[-1], *completions[:-1]]  # TRL's add_kl_completion_ids
    batch = trainer.data_collator([{"prompt_ids": p, "completion_ids": c, "label": label, "KL_completion_ids": k}
                                   for (p, c, label), k in zip(rows, kl)])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return TRLResult(loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}, hf_grads(trainer.model))


def unpaired_batch(rows) -> dict[str, np.ndarray]:
    """``rows`` as the data pipeline lays them out: `UnpairedRows` items (2, T) (the row, its KL row) and labels."""
    from jaxtune.data.unpaired import EncodedRow, UnpairedRows

    encoded = [EncodedRow(Encoded(np.array(p + c, np.int32), np.array([0] * len(p) + [1] * len(c), bool)), len(p),
                          label) for p, c, label in rows]
    items = UnpairedRows.of(encoded, T, chunk=len(rows))
    return {k: np.stack([items[i][k] for i in range(len(items))]) for k in items[0]}


def ours_kto(native: Native, rows, **keys) -> Ours:
    """KTO as the step runs it: `KTO.prepare` on the whole batch (the KL baseline, with the frozen copy as the
    reference), then the loss and its gradients."""
    cfg = objective_config(name="kto", **keys)
    objective = make_objective(cfg)
    reference = step_reference(native.spec, cfg)
    with sharding.use_mesh(MESH):
        batch = sharding.global_batch(MESH, unpaired_batch(rows))
        prepared = jax.jit(lambda b: objective.prepare(native.spec.forward(), native.policy, b,
                                                       reference.bind(native.policy, Frozen((), native.ref))))(batch)
    prepared = jax.device_get(prepared)
    means = lambda metrics, count: {k: float(v[0]) / max(float(v[1]), 1.0) for k, v in metrics.items()}
    return trl_reference.objective_result(native, objective, cfg, native.policy, prepared, means)


@pytest.mark.parametrize("loss_type, keys, swapped", [
    ("kto", {"beta": 0.1}, False),
    ("kto", {"beta": 0.5, "desirable_weight": 1.3, "undesirable_weight": 0.7}, True),
    ("apo_zero_unpaired", {"beta": 0.5}, False),
])
def test_kto_matches_trl_kto_trainer(checkpoints, tokenizer, native, tmp_path, loss_type, keys, swapped):
    """Full fine-tuning, the reference a frozen copy: loss, metrics and gradients equal KTOTrainer's; the KL baseline
    from each row's prompt with the previous row's completion. The perturbed policy scores the mismatched rows below
    the reference (TRL clamps that KL to 0); with the two checkpoints' roles swapped (``swapped``) above it, so the
    baseline is positive and enters every reward."""
    if swapped:
        checkpoints = {"policy": checkpoints["ref"], "ref": checkpoints["policy"]}
        native = replace(native, policy=native.ref, ref=native.policy, compiled={})
    theirs = trl_kto(checkpoints, tokenizer, tmp_path, UNPAIRED, loss_type=loss_type, **keys)
    mine = ours_kto(native, UNPAIRED, loss_type=loss_type, **keys)
    assert mine.count == len(UNPAIRED)
    assert theirs.metrics["rewards/chosen"] != theirs.metrics["rewards/rejected"]
    kl = theirs.metrics["kl"]
    assert (kl > 1e-3) == (swapped and loss_type == "kto"), kl
    assert mine.metrics["kl"] == pytest.approx(kl, rel=TOL, abs=0.0 if kl else 1e-12), (mine.metrics["kl"], kl)
    trl_reference.assert_close(mine, theirs, KTO_METRICS, lambda k, a, b: rel(a[k], b[k]))
